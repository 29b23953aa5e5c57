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
from tests.multirank.programs.train_edges import Boom

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


class Fragile(nn.Module):
    """zero_job's model with ``Boom`` between its first and its last layers: a backward that
    raises there has produced (and reduced) the last layers' gradients, not the first's."""

    def __init__(self):
        super().__init__()
        self.net = make_model()

    def forward(self, x):
        return self.net[3](self.net[2](Boom.apply(self.net[1](self.net[0](x)))))


def _fragile_reference(steps: list, world: int) -> dict:
    model = Fragile()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=SGD["params"]["lr"])
    for step in steps:
        opt.zero_grad()
        xs, ys = zip(*(data(r, step) for r in range(world)))
        nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def _train_fragile(cfg: dict, rank: int, steps: list, raise_at: int | None = None):
    """The engine trained on ``steps``' data; at ``raise_at`` a backward that raises, then
    ``zero_grad()`` and no step."""
    engine = initialize(Fragile(), {"optimizer": SGD, **cfg})
    for step in steps:
        x, y = data(rank, step)
        loss = nn.functional.mse_loss(engine(x), y)
        if step != raise_at:
            engine.backward(loss)
            engine.step()
            continue
        Boom.armed = True
        try:
            engine.backward(loss)
            raise AssertionError("the backward did not raise")
        except RuntimeError as exc:
            assert "an error in backward" in str(exc), exc
        finally:
            Boom.armed = False
        engine.zero_grad()
        assert engine.zero.live_bytes == 0 and not engine.zero.works, engine.zero.live_bytes
    return engine


ZERO_GRAD = {"stage 0": {"stage": 0}, "stage 1": {"stage": 1}, "stage 2": {"stage": 2}, "stage 3": {"stage": 3},
             "stage 1 bf16": {"stage": 1}, "stage 2 bf16": {"stage": 2}, "stage 3 bf16": {"stage": 3},
             "MiCS /1 bf16": {"stage": 3, "mics_shard_size": 1}}


HYBRID = {"HYBRID_SHARD": {"sharding_strategy": "HYBRID_SHARD", "shard_group_size": 2},
          "HYBRID_SHARD bf16": {"sharding_strategy": "HYBRID_SHARD", "shard_group_size": 2},
          "_HYBRID_SHARD_ZERO2": {"sharding_strategy": "_HYBRID_SHARD_ZERO2", "shard_group_size": 2},
          "hpZ": {"stage": 3, "zero_hpz_partition_size": 2},
          "qwZ+qgZ stream bf16": {"stage": 3, "zero_quantized_weights": True, "zero_quantized_gradients": True,
                                  "overlap_comm": True}}


def zero_grad_case(rank: int, world: int, layouts: dict = ZERO_GRAD) -> None:
    """A backward that raised on every rank halfway (after the last layers' reductions started)
    left their reduced gradients in the units, in flight, or gathered (stage 3), and there was
    no engine.zero_grad() to drop them: the next step added them in (0.0036 from torch after
    two more SGD steps). Now zero_grad() drops them and the run equals one that skipped that
    step: torch's in fp32, the engine's own in bf16 (bit for bit)."""
    for what, zero in layouts.items():
        bf16 = what.endswith("bf16")
        cfg = {"zero_optimization": {"reduce_bucket_size": 40, **zero}, "bf16": {"enabled": bf16}}
        got = _train_fragile(cfg, rank, [0, 1, 2, 3], raise_at=1).full_state_dict()
        if bf16:
            want = _train_fragile(cfg, rank, [0, 2, 3]).full_state_dict()
        else:
            want = _fragile_reference([0, 2, 3], world)
        compare(got, want, f"{what}: zero_grad after a backward that raised", atol=0 if bf16 else 1e-6)


CASES = {"forward_raised": forward_raised_case, "zero_grad": zero_grad_case,
         "zero_grad_hybrid": lambda rank, world: zero_grad_case(rank, world, HYBRID)}  # 4 ranks


def main() -> int:
    torch.set_num_threads(1)
    commrt.init_process_group()
    for case in sys.argv[1].split(","):  # several cases in one launch: one torch import per rank
        CASES[case](commrt.get_rank(), commrt.get_world_size())
    commrt.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
