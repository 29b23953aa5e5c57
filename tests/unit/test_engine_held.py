"""A module an open engine holds gets no second engine: both engines' gradient hooks would
reduce its gradients (world size 1: the check is in-process and runs before any collective)."""
import pytest
import torch
from torch import nn

import commrt
from commrt.runtime.errors import ConfigError
from commrt.train import initialize

SGD = {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def _train(engine):
    x, y = torch.ones(2, 3), torch.zeros(2, 2)
    engine.backward(nn.functional.mse_loss(engine(x), y))
    assert engine.step()


@pytest.mark.parametrize("stage", [0, 3])
def test_a_second_engine_on_a_held_module_is_refused_until_close(world1, stage):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    cfg = {**SGD, "zero_optimization": {"stage": stage}}
    first = initialize(model, cfg)
    with pytest.raises(ConfigError, match="held by an open engine"):
        initialize(model, cfg)
    with pytest.raises(ConfigError, match="held by an open engine"):
        initialize(model[0], cfg)  # a part of it: the same parameters
    _train(first)  # the refused initialize left the first engine as it was
    other = initialize(nn.Linear(3, 2), cfg)  # another module is free
    first.close()
    second = initialize(model, cfg)  # closing released it
    _train(second)
    second.close()
    other.close()
