"""replica_vote.py against an in-memory store: a vote whose wait times out reports how many had
voted, and the leader then stops waiting once that many previous members registered instead of
waiting its whole deadline for the silent one (an overlapped all-reduce can complete before a
replica dies, so no collective names it lost)."""
from __future__ import annotations

import time

import msgpack
import pytest

from commrt.runtime.errors import RendezvousError
from commrt.runtime.store_core import ABORT, OK, TIMEOUT
from commrt.train import replica_quorum as q
from commrt.train import replica_vote as rv


class Store:
    def __init__(self):
        self.kv: dict[str, object] = {}

    def add(self, key, amount):
        self.kv[key] = self.kv.get(key, 0) + amount
        return self.kv[key]

    def set(self, key, value):
        self.kv[key] = value

    def mget(self, keys):
        return [self.kv.get(k) for k in keys]

    def wait_count(self, key, target, abort_key, timeout_s):
        value = self.kv.get(key, 0)
        return [OK, value] if value >= target else [TIMEOUT, value]

    def add_wait_count(self, key, amount, target, abort_key, timeout_s):
        added = self.add(key, amount)
        return [*self.wait_count(key, target, abort_key, timeout_s), added]

    def wait(self, keys, abort_key, timeout_s):
        if abort_key is not None and abort_key in self.kv:
            return [ABORT, self.kv[abort_key]]
        values = self.mget(keys)
        return [OK, values] if None not in values else [TIMEOUT, [k for k, v in zip(keys, values) if v is None]]


def test_a_vote_that_times_out_aborts_and_counts_the_voters():
    store = Store()
    store.kv[f"{rv.P}v/4"] = 3 * 5 + 1  # 3 members, 5 steps committed, one vote of step 5 in
    ok, voted = rv.vote(store, 4, 3 * 6, 3, True, 0.01, 1.0)  # ours: the second
    assert not ok and voted == 2
    assert int(store.kv[f"{rv.P}dec/4"]) == 3 * 5 + 2, "the ender records the votes before it"
    ok, voted = rv.vote(store, 5, 3, 3, True, 0.01, 1.0)
    assert not ok and voted == 1


def test_a_committed_vote_reports_no_count():
    store = Store()
    store.kv[f"{rv.P}v/0"] = 2
    assert rv.vote(store, 0, 3, 3, True, 0.01, 1.0) == (True, None)


def _register(store, gen, r):
    store.set(f"{rv.P}reg/{gen}/{r}", msgpack.packb(q.Registration(r, 7, True).pack()))


def test_the_leader_waits_only_for_as_many_as_voted():
    store = Store()
    _register(store, 2, 0)
    _register(store, 2, 1)  # replica 2 never registers (dead, not named by any collective)
    t0 = time.monotonic()
    rv.lead(store, 2, 3, (0, 1, 2), 5.0, 0, alive=2)
    assert time.monotonic() - t0 < 1.0
    plan = q.Plan.unpack(msgpack.unpackb(store.kv[f"{rv.P}mem/2"]))
    assert plan.members == (0, 1) and plan.step == 7


def test_without_the_count_the_leader_waits_its_deadline():
    store = Store()
    _register(store, 2, 0)
    _register(store, 2, 1)
    t0 = time.monotonic()
    rv.lead(store, 2, 3, (0, 1, 2), 0.3, 0)
    assert time.monotonic() - t0 >= 0.3


def test_a_replaced_replica_is_left_out_and_refused():
    """A frozen replica that wakes after its replacement started registers under the same key:
    the leader must plan with the newest start only, and the old one must be told to leave."""
    store = Store()
    _register(store, 3, 0)
    store.set(f"{rv.P}reg/3/1", msgpack.packb(q.Registration(1, 7, True, (), 1).pack()))  # the old start
    store.add(rv.incarnation_key(1), 2)  # starts 1 and 2 of replica 1 happened
    rv.lead(store, 3, 2, (0, 1), 0.05, 0)
    plan = q.Plan.unpack(msgpack.unpackb(store.kv[f"{rv.P}mem/3"]))
    assert plan.members == (0,) and not plan.includes(1, 1)
    rv.check_current(store, 1, 2, "here")  # the newest start goes on
    with pytest.raises(rv.StaleReplica, match=r"replica 1 .*start 1\) was replaced by start 2"):
        rv.check_current(store, 1, 1, "here")
    assert q.Plan(3, (0, 1), 7, (0,), 0, (), (1, 2)).includes(1, 2)


def test_a_vote_after_the_end_aborts_without_the_enders_record():
    """Our vote lands after a BIG (the generation ended, e.g. by a joiner) but completes the
    count: the step cannot have committed (it needed our vote before the first BIG). The ender
    died before writing dec/: the answer must not depend on it (it waited, then raised)."""
    store = Store()
    store.kv[f"{rv.P}v/4"] = q.BIG + 3 * 6 - 1  # every other vote of step 5 is in, after the BIG
    assert rv.vote(store, 4, 3 * 6, 3, True, 0.01, 0.05) == (False, None)
    assert f"{rv.P}dec/4" not in store.kv


def test_a_follower_skips_a_generation_whose_leader_never_wrote_its_plan():
    """The leader of generation 5 died in lead(): a follower (with state, registered after the
    leader began) gives up on it after its deadline and marks it skipped, so that every other
    waiter (a fresh replica, a group's other ranks) goes on to 6 with it; a plan, when there is
    one, is taken as ever."""
    store = Store()
    with pytest.raises(RendezvousError, match="plan of generation 5 still missing"):
        rv.plan_of(store, 5, 0.01, False, 0.01, 2)  # not a follower: no skip of its own
    assert rv.plan_of(store, 5, 0.01, True, 1.0, 1) is None and f"{rv.P}skip/5" in store.kv
    assert rv.plan_of(store, 5, 0.01, False, 1.0, 2) is None  # the others follow the skip
    plan = q.Plan(6, (1, 2), 9, (1,), 1, (2,), (1, 1))
    store.set(f"{rv.P}mem/6", msgpack.packb(plan.pack()))
    assert rv.plan_of(store, 6, 0.01, True, 1.0, 1) == plan


def test_the_job_ends_when_every_member_of_its_last_generation_has_left():
    """One member leaving early is not the job's end (the others go on without it); once every
    member of the last generation has left, a replica registered for the next one stops waiting
    (skip) and one (re)starting is told the job finished, with the step, instead of waiting out
    its join timeout for a plan nobody will write."""
    store = Store()
    assert rv.leave(store, 4, 3, 60) == 1  # one leaves early
    rv.check_current(store, 0, 1, "here")
    assert rv.plan_of(store, 5, 0.01, True, 1.0, 0) is None  # not finished: a follower's own skip
    assert rv.leave(store, 5, 2, 60) == 1 and rv.leave(store, 5, 2, 60) == 2  # generation 5's both
    assert rv.plan_of(store, 6, 0.01, False, 60.0, 0) is None  # the joiner's wait ends at once
    with pytest.raises(rv.JobFinished, match=r"replica 0 \(here\): the job's replicas finished at step 60 "
                                              r"\(generation 5\)"):
        rv.check_current(store, 0, 1, "here")
