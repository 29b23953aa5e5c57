"""DeepSpeed's learning-rate schedules (``optim/schedules.py``) against their formulas written
out, the ``scheduler`` config section's errors, and the engine's get_lr / set_lr at world size 1."""
import math

import pytest
import torch
from torch import nn

import commrt
from commrt.optim.schedules import LRSchedule, lr_at
from commrt.runtime.errors import ConfigError
from commrt.train import TrainConfig, initialize


def sched(kind, **params):
    return TrainConfig.from_dict({"scheduler": {"type": kind, "params": params}}).scheduler


def test_warmup_lr_log_and_linear():
    s = sched("WarmupLR", warmup_min_lr=0.1, warmup_max_lr=1.1, warmup_num_steps=10)
    assert lr_at(s, 0, 5.0) == pytest.approx(0.1)  # the first step runs at the minimum
    assert lr_at(s, 4, 5.0) == pytest.approx(0.1 + 1.0 * math.log(5) / math.log(10))
    assert lr_at(s, 10, 5.0) == lr_at(s, 1000, 5.0) == pytest.approx(1.1)
    lin = sched("WarmupLR", warmup_max_lr=2.0, warmup_num_steps=4, warmup_type="linear")
    assert [lr_at(lin, n, 0.0) for n in range(6)] == pytest.approx([0.0, 0.5, 1.0, 1.5, 2.0, 2.0])
    assert lr_at(sched("WarmupLR", warmup_num_steps=0, warmup_type="linear"), 1, 0.0) == pytest.approx(0.0005)


def test_warmup_decay_lr_falls_linearly_to_zero_at_total():
    s = sched("WarmupDecayLR", warmup_max_lr=1.0, warmup_num_steps=4, total_num_steps=12, warmup_type="linear")
    got = [lr_at(s, n, 9.0) for n in range(14)]
    want = [n / 4 for n in range(4)] + [(12 - n) / 8 for n in range(4, 12)] + [0.0, 0.0]
    assert got == pytest.approx(want)


def test_warmup_cosine_lr_is_a_ratio_of_the_optimizer_lr():
    s = sched("WarmupCosineLR", warmup_num_steps=2, total_num_steps=10, warmup_min_ratio=0.2,
              cos_min_ratio=0.1, warmup_type="linear")
    base = 4.0
    assert lr_at(s, 0, base) == pytest.approx(0.8) and lr_at(s, 1, base) == pytest.approx(base * (0.2 + 0.8 * 0.5))
    for n in range(2, 10):  # DeepSpeed: (1 + cos(pi * (n - warmup + 1) / (total - warmup))) / 2
        ratio = 0.1 + 0.9 * (1 + math.cos(math.pi * (n - 1) / 8)) / 2
        assert lr_at(s, n, base) == pytest.approx(base * ratio)
    assert lr_at(s, 9, base) == pytest.approx(0.4) == lr_at(s, 50, base)  # held at the floor


@pytest.mark.parametrize("raw,words", [
    ({"type": "OneCycle"}, "OneCycle"),
    ({"type": "WarmupLR", "params": {"warmup_max": 1}}, "unknown key"),
    ({"type": "WarmupLR", "params": {"warmup_max_lr": -1}}, "warmup_max_lr"),
    ({"type": "WarmupLR", "params": {"warmup_max_lr": "1e-3"}}, "warmup_max_lr"),
    ({"type": "WarmupLR", "params": {"warmup_num_steps": 2.5}}, "warmup_num_steps"),
    ({"type": "WarmupLR", "params": {"warmup_type": "cos"}}, "warmup_type"),
    ({"type": "WarmupDecayLR", "params": {}}, "total_num_steps"),
    ({"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10, "total_num_steps": 5}}, "before the warmup"),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "cos_min_ratio": 1.5}}, "cos_min_ratio"),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_min_lr": 0.1}}, "unknown key"),
    ({"type": "WarmupLR", "extra": 1}, "unknown key"),
    ("WarmupLR", "a table"),
])
def test_bad_scheduler_sections_are_config_errors(raw, words):
    with pytest.raises(ConfigError, match=words):
        TrainConfig.from_dict({"scheduler": raw})


def test_no_scheduler_section_means_none():
    assert TrainConfig.from_dict({}).scheduler is None
    assert isinstance(sched("WarmupLR"), LRSchedule)


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, 3, generator=g), torch.randn(4, 2, generator=g)


def _step(engine, seed):
    x, y = _batch(seed)
    engine.backward(nn.functional.mse_loss(engine(x), y))
    assert engine.step()


def test_engine_get_and_set_lr(world1, tmp_path):
    torch.manual_seed(0)
    engine = initialize(nn.Linear(3, 2), {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    assert engine.get_lr() == [0.1]
    engine.set_lr(0.25)
    ref = nn.Linear(3, 2)
    ref.load_state_dict(engine.module.state_dict())
    x, y = _batch(1)
    nn.functional.mse_loss(ref(x), y).backward()
    want = ref.weight.detach() - 0.25 * ref.weight.grad  # SGD without momentum: the step ran at 0.25
    _step(engine, 1)
    assert engine.get_lr() == [0.25]
    torch.testing.assert_close(engine.module.weight.detach(), want, rtol=0, atol=1e-7)
    with pytest.raises(ConfigError, match="lr"):
        engine.set_lr(-1.0)
    with pytest.raises(ConfigError, match="lr"):
        engine.set_lr(float("nan"))
    assert engine.get_lr() == [0.25]  # a refused value changed nothing
    engine.save_checkpoint(str(tmp_path))
    engine.close()
    again = initialize(nn.Linear(3, 2), {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    again.load_checkpoint(str(tmp_path))
    assert again.get_lr() == [0.25]  # the rate set_lr gave is the checkpoint's
    again.close()


def test_engine_with_a_scheduler_follows_it_and_refuses_set_lr(world1):
    torch.manual_seed(0)
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.3, "warmup_num_steps": 3,
                                                        "warmup_type": "linear"}}}
    engine = initialize(nn.Linear(3, 2), cfg)
    seen = [engine.get_lr()[0]]
    for k in range(4):
        _step(engine, k)
        seen.append(engine.get_lr()[0])
    assert seen == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.3])
    with pytest.raises(ConfigError, match="scheduler"):
        engine.set_lr(0.5)
    engine.close()


def test_a_scheduler_with_the_replica_loop_is_refused():
    """train_lm's replica loop steps torch's optimizer: the section would be silently ignored."""
    with pytest.raises(ConfigError, match="fault_tolerance"):
        TrainConfig.from_dict({"fault_tolerance": "replica",
                               "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}})


def test_a_skipped_step_does_not_advance_the_schedule(world1):
    """As DeepSpeed, which steps its scheduler only when the optimizer stepped (no overflow)."""
    torch.manual_seed(0)
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}, "non_finite_grads": "skip",
           "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.3, "warmup_num_steps": 3,
                                                        "warmup_type": "linear"}}}
    engine = initialize(nn.Linear(3, 2), cfg)
    _step(engine, 0)
    assert engine.get_lr() == pytest.approx([0.1])
    x, y = _batch(1)
    engine.backward(nn.functional.mse_loss(engine(x), y) * float("nan"))
    assert not engine.step() and engine.skipped_steps == 1
    assert engine.get_lr() == pytest.approx([0.1])
    _step(engine, 2)
    assert engine.get_lr() == pytest.approx([0.2])
    engine.close()
