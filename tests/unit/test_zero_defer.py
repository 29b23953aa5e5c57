"""HYBRID_SHARD's overlapped step (commrt/train/zero_defer.py) without processes: which units
hold their replica all-reduce back, the order every rank issues the collectives in (the hooks'
order for the rest, forward order for the held ones, whatever order their reduce-scatters ended
in), and a unit's step taken only once its all-reduce landed. The values are checked against
single-process training in tests/multirank/test_hybrid.py."""
import threading

import pytest
import torch
from torch import nn

from commrt.optim import rules as optim
from commrt.runtime.errors import CommError
from commrt.runtime.work import Work
from commrt.train.breakdown import StepClock
from commrt.train.layout import make_unit
from commrt.train.units import UnitState
from commrt.train.zero import Zero


def _zero(sizes):
    """A Zero with the queue logic alone: collectives recorded, finished by the test."""
    z = Zero.__new__(Zero)
    z.world, z.stage, z.qgz, z.dtype, z.overlap, z.rgroup, z.stream = 2, 3, False, torch.float32, True, "replicas", None
    z.works, z.clock, z.nonfinite, z.started_early, z.resident = [], StepClock(), False, 0, False
    z.defer, z.late, z.held, z.holding, z.deferred_steps, z.steps_in_forward = True, {}, [], False, 0, 0
    z.spec = z.due_spec = optim.OptimSpec("sgd", lr=0.5)
    z.shard_rank, z.shards, z.hgroup, z.live_bytes, z.peak_live_bytes = 0, 1, None, 0, 0
    issued, works = [], {}
    z.units = []
    for i, n in enumerate(sizes):
        p = nn.Parameter(torch.ones(n))
        p.grad = torch.full((n,), float(i + 1))
        u = UnitState(make_unit([0], [n], 2), [p], (0, n // 2))
        u.name, u.master, u.grad, u.grad_zero = i, torch.zeros(n // 2), torch.zeros(n // 2), True
        u.state = optim.init_state(z.spec, u.master)
        z.units.append(u)
    names = {}

    def start(kind, out, u=None):
        name = f"{kind} {names[id(out)] if u is None else u.name}"
        if u is not None:
            names[id(out)] = u.name
            out.fill_(u.name + 1.0)  # the reduced shard
        issued.append(name)
        works[name] = Work(name)
        return works[name]
    z._start_reduce_scatter = lambda out, flat, u: start("reduce_scatter", out, u)
    z._start_replica_all_reduce = lambda out: start("all_reduce", out)
    z.release = lambda u: None
    return z, issued, works


def test_the_first_units_of_forward_hold_back_three_quarters_of_the_bytes():
    z, _, _ = _zero([8, 8, 16, 32, 64, 8])
    z.hold_back(z.units)  # 136 elements: the first units until 102 are reached
    assert sorted(z.late) == sorted(id(u) for u in z.units[:5])
    z.hold_back(list(reversed(z.units)))  # forward's order is what counts, not registration
    assert [u.name for u in z.units if id(u) in z.late] == [3, 4, 5]


def test_held_all_reduces_start_after_backward_in_forward_order_and_steps_wait_for_them():
    z, issued, works = _zero([4, 4, 4, 4])
    z.hold_back(z.units[:2] + z.units[2:])  # held: units 0, 1, 2 (12 of 16 elements)
    assert len(z.late) == 3
    for u in reversed(z.units):  # backward: the last unit's gradient first
        z.reduce(u)
    # unit 3 (not held) chains its all-reduce to its reduce-scatter; the held ones only scatter
    assert issued == ["reduce_scatter 3", "reduce_scatter 2", "reduce_scatter 1", "reduce_scatter 0"]
    for name in ["reduce_scatter 3", "reduce_scatter 0", "reduce_scatter 1", "reduce_scatter 2"]:
        works[name]._finish(None, None)  # the held ones end in any order
    z.issue_backward()
    assert issued[4:] == ["all_reduce 3", "all_reduce 0", "all_reduce 1", "all_reduce 2"]
    z.defer_update(1, 1.0)
    u0 = z.units[0]
    assert u0.step_due == (1, 1.0) and not z.start_gather(u0)  # a prefetch stops at a due step
    works["all_reduce 0"]._finish(None, None)
    before = u0.master.clone()
    z.settle(u0)  # lands the all-reduce into the gradient, then steps
    assert u0.step_due is None and z.steps_in_forward == 1
    assert torch.equal(u0.master, before - 0.5 * 1.0)  # SGD on the landed shard (ones), then zeroed
    assert not u0.grad.any() and u0.grad_zero
    assert z.units[1].step_due == (1, 1.0) and z.units[1].landing is not None  # not landed: not stepped


def _issue_order(finish_last_scatter_before_issue: bool) -> list[str]:
    """One rank's replica all-reduce order when a unit that is not held (3, the last of forward)
    is reduced after the held ones: the engine's flush of a unit with a parameter that got no
    gradient (Engine._backward), after every gradient hook."""
    import threading
    z, issued, works = _zero([4, 4, 4, 4])
    z.hold_back(z.units)  # held: units 0, 1, 2
    for u in [z.units[2], z.units[1], z.units[0], z.units[3]]:  # backward's hooks, then the flush
        z.reduce(u)
    for name in ["reduce_scatter 2", "reduce_scatter 1", "reduce_scatter 0"]:
        works[name]._finish(None, None)
    last = works["reduce_scatter 3"]
    if finish_last_scatter_before_issue:  # this rank's training thread came to issue_backward later
        last._finish(None, None)
        z.issue_backward()
    else:  # its executor finishes unit 3's reduce-scatter 0.2 s after the training thread got there
        timer = threading.Timer(0.2, last._finish, (None, None))
        timer.start()
        z.issue_backward()
        timer.join()
    return [n for n in issued if n.startswith("all_reduce")]


def test_every_rank_issues_the_replica_all_reduces_in_one_order_whatever_the_timing():
    """Two replicas of one shard whose reduce-scatter of unit 3 ended before / after their
    training thread reached issue_backward must still issue the replica all-reduces alike."""
    early, late = _issue_order(True), _issue_order(False)
    assert early == late, f"replica all-reduce order depends on timing: {early} vs {late}"


def test_a_failed_landing_keeps_failing_instead_of_stepping_without_its_gradient():
    """A replica all-reduce that failed (a lost peer) raises at the unit's settle; a later settle
    (the caller caught the error and saves, consolidates or trains on) must not take the unit's
    due step on a gradient that never arrived."""
    z, issued, works = _zero([4, 4])
    z.hold_back(z.units)  # held: both units (the first reaches 4 of the 6 elements that are 3/4)
    for u in reversed(z.units):
        z.reduce(u)
    for name in [n for n in issued if n.startswith("reduce_scatter")]:
        works[name]._finish(None, None)
    z.issue_backward()
    z.defer_update(1, 1.0)
    u0 = z.units[0]
    works["all_reduce 0"]._finish(None, CommError("lost peer rank 1 during all_reduce"))
    with pytest.raises(CommError):
        z.settle(u0)
    with pytest.raises(CommError):  # again: the step cannot be taken without the gradient
        z.settle(u0)
