"""A forward or a backward that raised, caught by the training loop, at world size 1 (the
multi-rank cases are in tests/multirank/test_train_edges.py): the engine lets go of what the
failed pass gathered or reduced, and the steps after it equal a run that never raised."""

import pytest
import torch
from torch import nn

import commrt
from commrt.train import initialize
from tests.multirank.programs.train_edges import Boom


class Raising(nn.Linear):
    """A linear layer whose forward raises while ``armed``."""
    armed = False

    def forward(self, x):
        out = super().forward(x)
        if Raising.armed:
            raise RuntimeError("an error in forward")
        return out


class Tied(nn.Module):
    """A module with a parameter of its own beside its children's, which reads the embedding
    again after ``emb`` ran (weight tying by use), and a child that may raise mid-forward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.mid, self.last = nn.Embedding(11, 8), nn.Linear(8, 8), Raising(8, 8)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 8))

    def forward(self, idx):
        h = self.last(torch.tanh(self.mid(self.emb(idx))) * self.scale)
        return h @ self.emb.weight.t()


def _train(engine, steps, raise_at=()):
    g = torch.Generator().manual_seed(2)
    for step in range(steps):
        idx = torch.randint(0, 11, (3, 5), generator=g)
        if step in raise_at:
            Raising.armed = True
            try:
                with pytest.raises(RuntimeError, match="an error in forward"):
                    engine(idx)
            finally:
                Raising.armed = False
            assert engine.zero.live_bytes == 0 and all(u.full is None for u in engine.zero.units)
            assert not any(engine._pins.values()) and not engine._running
        out = engine(idx).float()
        engine.backward(nn.functional.cross_entropy(out.reshape(-1, 11), idx.reshape(-1)))
        assert engine.step()
    return engine


@pytest.mark.parametrize("raise_at", [(0,), (2,)])
def test_stage3_a_forward_that_raised_releases_its_gathers(world1, raise_at):
    """A forward that raised inside a module left that module's unit and every unit it had
    gathered for itself pinned and gathered (held from then on); raised in the first forward,
    the engine stopped watching for reads outside a module before it had seen the model's read
    of ``emb.weight``, which every later forward met released. bf16 keeps stage 3 gathering at
    world size 1; the same run without the raise is the reference, bit for bit."""
    cfg = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3},
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    want = _train(initialize(Tied(), cfg), 4).full_state_dict()
    engine = _train(initialize(Tied(), cfg), 4, raise_at)
    assert engine.zero.live_bytes == 0
    for name, value in engine.full_state_dict().items():
        torch.testing.assert_close(value, want[name], rtol=0, atol=0, msg=name)


class Fragile(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.last = nn.Linear(4, 6), nn.Linear(6, 2)

    def forward(self, x):
        return self.last(Boom.apply(torch.tanh(self.first(x))))


def _batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g)


@pytest.mark.parametrize("stage,bf16", [(0, False), (1, False), (2, False), (3, False), (3, True)])
def test_zero_grad_drops_what_a_backward_left(world1, stage, bf16):
    """The engine had no zero_grad(): the gradients of a backward that raised halfway (the last
    layer's, reduced) and of one the caller dropped were added into the next step. Here: a
    backward that raised, one dropped on purpose, then steps; torch skips both."""
    ref = Fragile()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in (0, 3):
        opt.zero_grad()
        x, y = _batch(step)
        nn.functional.mse_loss(ref(x), y).backward()
        opt.step()
    engine = initialize(Fragile(), {"zero_optimization": {"stage": stage, "reduce_bucket_size": 10},
                                    "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "bf16": {"enabled": bf16}})
    for step in range(4):
        x, y = _batch(step)
        loss = nn.functional.mse_loss(engine(x).float(), y)
        Boom.armed = step == 1
        try:
            engine.backward(loss)
        except RuntimeError as exc:
            assert Boom.armed and "an error in backward" in str(exc), exc
        finally:
            Boom.armed = False
        if step in (1, 2):
            engine.zero_grad()
            assert engine.zero.live_bytes == 0
        else:
            assert engine.step()
            engine.zero_grad()  # after a step: nothing to drop
    got = engine.full_state_dict()
    for name, want in ref.named_parameters():
        torch.testing.assert_close(got[name], want.detach(), rtol=0, atol=1e-2 if bf16 else 1e-6, msg=name)
