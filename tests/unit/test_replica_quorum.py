"""replica_quorum: every member reads the same verdict from the vote counter, whatever the order
of the adds and of the waits' arrivals (issue 33 item 2), and the next generation's plan."""
from __future__ import annotations

import itertools

import pytest

from commrt.train import replica_quorum as q


def _verdicts(order: list[tuple[int, str]], n: int, t: int, waits_at: dict[int, int]) -> dict[int, bool]:
    """Replay adds in ``order`` (member, "ok"|"big") on a counter that already holds the n*t
    votes of the earlier steps; a member's wait is answered when it arrives (after the add at
    index ``waits_at[m]``) if the counter has crossed the target, else at the crossing. Returns
    each member's verdict, read the way ReplicaFT._vote reads it."""
    target, value, history = n * (t + 1), n * t, []
    k_first = None
    for m, kind in order:
        value += 1 if kind == "ok" else q.BIG
        history.append(value)
        if kind == "big" and k_first is None:
            k_first = q.first_big(value)
    crossing = next(v for v in history if v >= target)
    verdicts = {}
    for i, (m, kind) in enumerate(order):
        result = q.outcome(history[i], target) if kind == "ok" else (
            q.UNKNOWN if q.first_big(history[i]) is None else
            (q.COMMIT if q.committed(q.first_big(history[i]), target) else q.ABORT))
        if result == q.UNKNOWN and kind == "ok" and history[i] < q.BIG:
            seen = history[max(waits_at[m], i)]
            result = q.outcome(seen if seen >= target else crossing, target)
        if result == q.UNKNOWN:
            result = q.COMMIT if q.committed(k_first, target) else q.ABORT
        verdicts[m] = result == q.COMMIT
    return verdicts


@pytest.mark.parametrize("t", [0, 3])
def test_every_member_reads_the_same_verdict(t):
    n = 3
    # members 0..2 each vote once; member 3 stands for a joiner (or a timed-out member's second add)
    for kinds in itertools.product(["ok", "big"], repeat=n):
        votes = [(m, k) for m, k in enumerate(kinds)] + ([(3, "big")] if "big" not in kinds else [])
        for order in itertools.permutations(votes):
            truth = [k for _, k in order].index("big") >= n if kinds == ("ok",) * n else False
            for arrive in itertools.product(range(len(order)), repeat=n):
                got = _verdicts(list(order), n, t, dict(enumerate(arrive)))
                assert set(got.values()) == {truth}, (order, arrive, got)


def test_outcome_and_first_big():
    assert q.outcome(6, 6) == q.COMMIT and q.outcome(7, 6) == q.COMMIT  # others already voted on
    assert q.outcome(5, 6) == q.UNKNOWN
    assert q.outcome(q.BIG + 5, 6) == q.ABORT and q.outcome(q.BIG + 6, 6) == q.UNKNOWN
    assert q.first_big(q.BIG + 4) == 4 and q.first_big(2 * q.BIG + 4) is None


def _reg(r, applied, grad=True, suspects=()):
    return q.Registration(r, applied, grad, tuple(suspects))


def test_plan_keeps_contributors_and_sends_state_to_the_fresh():
    plan = q.plan(4, {0: _reg(0, 12), 2: _reg(2, 12, grad=False), 1: _reg(1, -1, grad=False)})
    assert plan == q.Plan(4, (0, 1, 2), 12, (0,), 0, (1,), (0, 0, 0))
    assert q.Plan.unpack(plan.pack()) == plan
    with pytest.raises(RuntimeError, match="disagree"):
        q.plan(1, {0: _reg(0, 3), 1: _reg(1, 4)})
    with pytest.raises(RuntimeError, match="no registered replica holds"):
        q.plan(1, {1: _reg(1, -1)})


def test_the_leader_does_not_wait_for_a_replica_named_lost():
    regs = {0: _reg(0, 5, suspects=[2])}
    assert q.awaited((0, 1, 2), regs) == {1}
    assert q.awaited((0, 1, 2), {**regs, 1: _reg(1, 5)}) == set()
