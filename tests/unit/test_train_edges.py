"""Edge cases of the training engine at world size 1 found by the training review, each against
plain torch (the multi-rank ones are in tests/multirank/test_train_edges.py)."""

import time

import pytest
import torch
from torch import nn

import commrt
from commrt.runtime.errors import ConfigError
from commrt.train import EngineClosed, NonFiniteGradients, initialize


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


def _adamw(stage: int) -> dict:
    return {"zero_optimization": {"stage": stage}, "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}}}


def _freeze_before_initialize_equals_torch(stage: int) -> None:
    """A parameter frozen before initialize is not the engine's: never stepped, kept as it is."""
    ref = _net()
    ref[0].requires_grad_(False)
    frozen = ref[0].weight.detach().clone()
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=0.01, weight_decay=0.1,
                            foreach=False)
    model = _net()
    model[0].requires_grad_(False)
    engine = initialize(model, _adamw(stage))
    for step in range(3):
        opt.zero_grad()
        _loss(ref, step).backward()
        opt.step()
        engine.backward(_loss(engine, step))
        engine.step()
    got = engine.full_state_dict()
    assert torch.equal(got["0.weight"], frozen) and torch.equal(model[0].weight.detach(), frozen)
    for name, want in ref.named_parameters():
        assert torch.allclose(got[name], want, atol=1e-6), name


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_freezing_is_honoured_before_initialize_and_refused_after(world1, stage):
    """A layer frozen after initialize kept moving (AdamW momentum and decay on a zero gradient,
    where torch skips a parameter without .grad); one unfrozen after it would never be stepped."""
    _freeze_before_initialize_equals_torch(stage)
    engine = initialize(_net(), _adamw(stage))
    engine.backward(_loss(engine, 0))
    engine.step()
    engine.module[0].requires_grad_(False)
    with pytest.raises(ConfigError, match=r"parameter 0\.weight was frozen .* before initialize"):
        engine.backward(_loss(engine, 1))
    engine.module[0].requires_grad_(True)
    engine.module[2].bias.requires_grad_(False)
    with pytest.raises(ConfigError, match=r"parameter 2\.bias was frozen"):
        engine.backward(_loss(engine, 1))
    model = _net()
    model[0].requires_grad_(False)
    engine = initialize(model, _adamw(stage))
    engine.module[0].weight.requires_grad_(True)
    with pytest.raises(ConfigError, match=r"\['0\.weight'\] were unfrozen"):
        engine.backward(_loss(engine, 1))


class _Slow(nn.Linear):
    """A forward that takes ``delay`` seconds (set per step by the test)."""
    delay = 0.0

    def forward(self, x):
        time.sleep(self.delay)
        return super().forward(x)


def test_a_step_that_raised_is_not_added_to_the_next_steps_breakdown(world1):
    """non_finite_grads 'raise' skipped StepClock.finish_step: the failed step's forward and
    backward time went into the next step's step_breakdown()."""
    engine = initialize(_Slow(4, 2), {"non_finite_grads": "raise"})
    x = torch.randn(3, 4)
    engine.module.delay = 0.2
    engine.backward(engine(x).sum() * float("nan"))
    with pytest.raises(NonFiniteGradients):
        engine.step()
    assert engine.step_breakdown().forward >= 0.2  # the step that raised is the one reported
    engine.module.delay = 0.0
    engine.backward(engine(x).sum())
    assert engine.step()
    assert engine.step_breakdown().forward < 0.1, engine.step_breakdown()


def _sgd(momentum: float):
    return initialize(_net(), {"zero_optimization": {"stage": 0, "reduce_bucket_size": 10},
                               "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": momentum}}})


@pytest.mark.parametrize("saved,loaded", [(0.0, 0.9), (0.9, 0.0)])
def test_a_checkpoint_of_other_optimizer_state_is_a_config_error(world1, tmp_path, saved, loaded):
    """SGD momentum changed between save and load: the state arrays were read misaligned (a raw
    RuntimeError, or values taken for momentum)."""
    engine = _sgd(saved)
    engine.backward(_loss(engine, 0))
    engine.step()
    engine.save_checkpoint(str(tmp_path))
    state = engine.state_dict()
    with pytest.raises(ConfigError, match=r"optimizer state .* differs from this optimizer's"):
        _sgd(loaded).load_checkpoint(str(tmp_path))
    with pytest.raises(ConfigError, match=r"optimizer state .* differs from this optimizer's"):
        _sgd(loaded).load_state_dict(state)
    del state["meta"]["optimizer_state"]  # as written before the names were saved: loads as then
    same = _sgd(saved)
    same.load_state_dict(state)
    assert all(torch.equal(v, engine.full_state_dict()[k]) for k, v in same.full_state_dict().items())


@pytest.mark.parametrize("zero", [{"stage": 0}, {"stage": 2}, {"stage": 3},
                                  {"stage": 3, "zero_quantized_gradients": True, "overlap_comm": True}])
def test_a_closed_engine_is_read_not_trained(world1, tmp_path, zero):
    """After close(), a backward at stage 3 released the module's parameters (each left empty,
    the trained values gone from the model), and at every stage a step wrote the engine's values
    over what a plain loop had made of the parameters since; with ZeRO++'s comm stream (closed)
    full_state_dict() and save_checkpoint() raised 'zero-stream is closed'. Now the closed engine
    still reads (values, checkpoints) and refuses to train or load, naming the call."""
    engine = initialize(_net(), {"bf16": {"enabled": True}, "zero_optimization": zero,
                                 "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    engine.backward(_loss(engine, 0).float())
    engine.step()
    values = engine.full_state_dict()
    engine.close()
    held = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    assert all(torch.equal(v, engine.full_state_dict()[k]) for k, v in values.items())
    engine.save_checkpoint(str(tmp_path))
    loss = _loss(engine, 1).float()
    for call, args in (("backward", (loss,)), ("step", ()), ("zero_grad", ()),
                       ("load_checkpoint", (str(tmp_path),)), ("load_state_dict", (engine.state_dict(),))):
        with pytest.raises(EngineClosed, match=rf"engine\.{call}\(\) after close"):
            getattr(engine, call)(*args)
    for name, p in engine.module.named_parameters():
        assert torch.equal(p.detach(), held[name]), name


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_load_in_the_middle_of_an_accumulation_drops_its_gradients(world1, tmp_path, stage):
    """A checkpoint loaded after a micro-step's backward, before its step (a loop that recovers
    from a failure by loading the last save): stages 2-3 dropped that backward's gradient with
    the rest of the state, stages 0-1 kept it in p.grad (accumulated locally before the boundary)
    and added it into the next step (0.028 from a fresh engine that loaded the same save)."""
    cfg = {"zero_optimization": {"stage": stage}, "gradient_accumulation_steps": 2,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    saved = initialize(_net(), cfg)
    for step in (0, 1):
        saved.backward(_loss(saved, step))
    assert saved.step()
    saved.save_checkpoint(str(tmp_path))
    engines = [initialize(_net(), cfg), initialize(_net(), cfg)]
    engines[0].backward(_loss(engines[0], 5))  # the micro-step a failure interrupted
    for engine in engines:
        engine.load_checkpoint(str(tmp_path))
        for step in (2, 3):
            engine.backward(_loss(engine, step))
        assert engine.step()
    got, want = (e.full_state_dict() for e in engines)
    for name, value in want.items():
        assert torch.equal(got[name], value), name
