"""A forward or a backward that raised on every rank, caught by the training loop, then training
on: against single-process torch on the global batch that never ran the failed pass (zero_job's
data and comparison). ``python -m tests.multirank.programs.train_raised <case>[,<case>]``; each
prints 'OK <what>' or raises."""
from __future__ import annotations

import sys

import torch
from torch import nn

import commrt
from commrt.train import initialize
from tests.multirank.programs.zero_job import compare, data, make_model

SGD = {"type": "SGD", "params": {"lr": 0.1}}


class Outer(nn.Module):
    """zero_job's model under a module with a parameter of its own (so that stage 3 holds every
    child's unit through its first forward), whose forward raises while ``armed``."""
    armed = False

    def __init__(self):
        super().__init__()
        self.inner = make_model()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 5))

    def forward(self, x):
        out = self.inner(x) * self.gain
        if Outer.armed:
            raise RuntimeError("an error in forward")
        return out


def _reference(steps: int, world: int) -> dict:
    model = Outer()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=SGD["params"]["lr"])
    for step in range(steps):
        opt.zero_grad()
        xs, ys = zip(*(data(r, step) for r in range(world)))
        nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def forward_raised_case(rank: int, world: int) -> None:
    """Stage 3: a forward that raised inside a module kept that module's unit and the units it
    gathered for its children pinned and gathered from then on (and its prefetches in flight)."""
    for raise_at in (0, 1):  # the first forward (the one that learns the reads), and a later one
        engine = initialize(Outer(), {"zero_optimization": {"stage": 3, "reduce_bucket_size": 40},
                                      "optimizer": SGD})
        for step in range(3):
            x, y = data(rank, step)
            if step == raise_at:
                Outer.armed = True
                try:
                    engine(x)
                    raise AssertionError("the forward did not raise")
                except RuntimeError as exc:
                    assert "an error in forward" in str(exc), exc
                finally:
                    Outer.armed = False
                held = [u.layout.padded for u in engine.zero.units if u.full is not None or u.gathering is not None]
                assert not held and engine.zero.live_bytes == 0, (held, engine.zero.live_bytes)
            engine.backward(nn.functional.mse_loss(engine(x), y))
            engine.step()
        assert engine.zero.live_bytes == 0, engine.zero.live_bytes
        compare(engine.full_state_dict(), _reference(3, world), f"stage 3 after a forward that raised at {raise_at}",
                atol=1e-6)


CASES = {"forward_raised": forward_raised_case}


def main() -> int:
    torch.set_num_threads(1)
    commrt.init_process_group()
    for case in sys.argv[1].split(","):  # several cases in one launch: one torch import per rank
        CASES[case](commrt.get_rank(), commrt.get_world_size())
    commrt.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
