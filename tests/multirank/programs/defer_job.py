"""HYBRID_SHARD's overlapped step (commrt/train/zero_defer.py, ``overlap_step``) where its order
and its deferred step could go wrong: each case trains one model with ``overlap_step`` on and
off and requires the same values bit for bit (the feature's promise). Prints 'OK <case>' or
'FAIL <case>: ...' per case (tests/multirank/test_hybrid.py)."""
from __future__ import annotations

import dataclasses
import os
import sys
import time

import torch
from torch import nn

import commrt
from commrt.train import NonFiniteGradients, initialize
from tests.multirank.programs.zero_job import OPT, data, make_model

SHARD = 2


def engine(overlap: bool, kind: str = "adamw", model=None, **extra):
    zero = {"sharding_strategy": "HYBRID_SHARD", "shard_group_size": SHARD, "reduce_bucket_size": 40,
            "overlap_step": overlap}
    return initialize(model if model is not None else make_model(),
                      {"zero_optimization": zero, "optimizer": OPT[kind], **extra})


def one(e, rank: int, step: int, micro: int = 0, scale: float = 1.0) -> None:
    x, y = data(rank, step, micro)
    e.backward(nn.functional.mse_loss(e(x), y) * scale)


def same(a: dict, b: dict) -> str:
    bad = [f"{n} by {(a[n] - b[n]).abs().max().item():.3g}" for n in b if not torch.equal(a[n], b[n])]
    return "" if not bad else "differs: " + ", ".join(bad)


def report(case: str, err: str) -> None:
    print(f"{'FAIL' if err else 'OK'} {case}{': ' + err if err else ''}", flush=True)


class Last(nn.Module):
    """Runs last in forward (so not held), and ``spare`` gets no gradient: the engine reduces the
    unit in its flush after backward, after every held unit's reduce-scatter."""

    def __init__(self, spare: int):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 16) * 0.2)
        self.spare = nn.Parameter(torch.randn(spare) * 0.2)

    def forward(self, x):
        return x @ self.w.t()


def unused_case(rank: int, spare: int) -> None:
    """spare 16: every unit's shard is 136 elements, so a different order of the replica
    all-reduces on the two replicas averages one unit's shard with another's, silently; spare 8:
    the sizes differ, so it is a collective mismatch. One replica's training thread comes to the
    end of backward 0.3 s late (a GC pause, a preemption) so that the race goes one way there."""
    states = {}
    for overlap in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16),
                              nn.Tanh(), Last(spare))
        e = engine(overlap, "sgd", model=model)
        z = e.zero
        if rank // SHARD == 1:
            issue = z.issue_backward

            def late_issue(issue=issue, z=z):
                if z.works or z.held:
                    time.sleep(0.3)
                issue()
            z.issue_backward = late_issue
        for step in range(3):
            g = torch.Generator().manual_seed(100 * step + rank)
            x, y = torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)
            e.backward(nn.functional.mse_loss(e(x), y))
            e.step()
        states[overlap] = e.full_state_dict()
    report(f"a unit reduced after the held ones (spare {spare})", same(states[True], states[False]))


def three_steps_on_and_off(rank: int, after_step) -> str:
    """Three steps with overlap_step on and off, ``after_step(engine, step)`` after each
    ``step()``; '' when the two end bit for bit alike."""
    states = {}
    for overlap in (True, False):
        e = engine(overlap)
        for step in range(3):
            one(e, rank, step)
            e.step()
            after_step(e, step)
        states[overlap] = e.full_state_dict()
    return same(states[True], states[False])


def double_step_case(rank: int) -> None:
    """step() twice without a backward between: the second steps on zero gradients."""
    report("step() twice", three_steps_on_and_off(rank, lambda e, step: e.step() if step == 1 else None))


def lr_case(rank: int) -> None:
    """A schedule that sets the next step's learning rate after step(): the step due keeps its own."""
    def halve(e, _step):
        e.zero.spec = dataclasses.replace(e.zero.spec, lr=e.zero.spec.lr * 0.5)
    report("learning rate changed after step()", three_steps_on_and_off(rank, halve))


def nonfinite_case(rank: int, policy: str) -> None:
    states, counts = {}, {}
    for overlap in (True, False):
        e = engine(overlap, non_finite_grads=policy)
        for step in range(4):
            one(e, rank, step, scale=float("nan") if (step == 1 and rank == 1) else 1.0)
            try:
                e.step()
            except NonFiniteGradients:
                pass
        states[overlap], counts[overlap] = e.full_state_dict(), (e.global_steps, e.skipped_steps)
    err = same(states[True], states[False]) or ("" if counts[True] == counts[False] else f"counts {counts}")
    report(f"non-finite gradients, {policy}", err)


def midrun_case(rank: int, directory: str) -> None:
    """settle, state_dict, a checkpoint and full_state_dict between and inside accumulation windows."""
    states = {}
    for overlap in (True, False):
        e = engine(overlap, gradient_accumulation_steps=2)
        one(e, rank, 0, 0)
        one(e, rank, 0, 1)
        e.step()
        e.settle()
        e.settle()
        first = e.full_state_dict()
        one(e, rank, 1, 0)
        e.settle()
        arrays = e.state_dict()["arrays"]
        one(e, rank, 1, 1)
        e.step()
        e.save_checkpoint(os.path.join(directory, f"mid-{overlap}"))
        one(e, rank, 2, 0)
        e.full_state_dict()
        one(e, rank, 2, 1)
        e.step()
        states[overlap] = (first, e.full_state_dict(), arrays)
    (a0, a1, aa), (b0, b1, ba) = states[True], states[False]
    err = same(a0, b0) or same(a1, b1)
    if not err and not all(torch.equal(a, b) for a, b in zip(aa, ba)):
        err = "state_dict arrays differ"
    report("settle, state_dict, checkpoint, full_state_dict mid-run", err)


def memory_case(rank: int) -> None:
    """Right after step() the reduced shards still landing are live memory too."""
    e = engine(True)
    for step in range(2):
        one(e, rank, step)
        e.step()
    z = e.zero
    grads = sum(u.grad.numel() * u.grad.element_size() for u in z.units)
    landing = sum(u.landing.args[1].numel() * u.landing.args[1].element_size() for u in z.units
                  if u.landing is not None)
    reported = e.memory_report()["gradients"]
    report(f"memory_report's gradients after step() ({reported} B; grad {grads} + landing {landing})",
           "" if reported >= grads + landing else "under-reported")


def cases(rank: int, directory: str) -> None:
    """Every case, on a world of 4 already initialized (programs/hybrid_job.py runs them too)."""
    unused_case(rank, 16)
    unused_case(rank, 8)
    double_step_case(rank)
    lr_case(rank)
    nonfinite_case(rank, "skip")
    nonfinite_case(rank, "raise")
    midrun_case(rank, directory)
    memory_case(rank)


def main() -> int:
    torch.set_num_threads(1)
    commrt.init_process_group()
    cases(commrt.get_rank(), os.environ["COMMRT_TEST_TMP"])
    commrt.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
