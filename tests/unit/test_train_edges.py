"""Edge cases of the training engine at world size 1 found by the training review, each against
plain torch (the multi-rank ones are in tests/multirank/test_train_edges.py)."""

import pytest
import torch
from torch import nn

import commrt
from commrt.launch import free_port
from commrt.train import initialize


@pytest.fixture
def world1():
    commrt.init_process_group(init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    commrt.destroy_process_group()


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g)


def _loss(model, step: int) -> torch.Tensor:
    x, y = _batch(step)
    return nn.functional.mse_loss(model(x), y)


@pytest.mark.parametrize("stage,bf16", [(0, False), (1, False), (2, False), (3, False), (0, True)])
def test_two_backwards_before_one_step_add_up(world1, stage, bf16):
    """Stages 0-1 dropped the first backward (their gradient buffer was zeroed at the next one)."""
    ref = _net()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        opt.zero_grad()
        _loss(ref, 2 * step).backward()
        _loss(ref, 2 * step + 1).backward()
        opt.step()
    engine = initialize(_net(), {"zero_optimization": {"stage": stage, "reduce_bucket_size": 10},
                                 "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "bf16": {"enabled": bf16}})
    for step in range(2):
        engine.backward(_loss(engine, 2 * step))
        engine.backward(_loss(engine, 2 * step + 1))
        engine.step()
    got = engine.full_state_dict()
    for name, want in ref.named_parameters():
        assert torch.allclose(got[name], want, atol=1e-2 if bf16 else 1e-6), name
