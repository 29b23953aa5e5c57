"""The elastic rendezvous's decisions (runtime/elastic.py ``Membership``), without sockets: time
and heartbeats in, generations out. The multi-process behaviour is tests/multirank/test_elastic.py."""
from __future__ import annotations

import time

import pytest

from commrt.runtime import elastic_agent
from commrt.runtime.elastic import (DONE, EXIT_LOST, EXIT_TOO_FEW, FAILED, IDLE, RUNNING, Coordinator, Membership,
                                    Policy, pack, parse_nnodes)
from commrt.runtime.errors import RendezvousError
from commrt.runtime.store_core import ABORT, OK, TIMEOUT


class Cluster:
    """Agents as the coordinator sees them: each beat bumps a sequence number."""

    def __init__(self, policy: Policy):
        self.m, self.now, self.beats, self.seq = Membership(policy, 0.0), 0.0, {}, 0

    def beat(self, node: int, state: str, gen: int, agent: str = "a", **extra) -> None:
        self.seq += 1
        self.beats[node] = {"id": f"{agent}{node}", "seq": self.seq, "state": state, "gen": gen,
                            "addr": f"10.0.0.{node}", "port": 5000 + node, **extra}

    def tick(self, dt: float = 0.5, silent: tuple = ()) -> list[tuple]:
        """Advance time; every node not in ``silent`` beats again (same state)."""
        self.now += dt
        for n, b in list(self.beats.items()):
            if n not in silent:
                self.beat(n, b["state"], b["gen"], b["id"][0], **{k: b[k] for k in ("rank", "code", "start") if k in b})
        return self.m.tick(self.now, {n: (None if n in silent else b) for n, b in self.beats.items()})


def plans(actions):
    return [a for a in actions if a[0] == "plan"]


def test_parse_nnodes():
    assert parse_nnodes("2:4") == (2, 4) and parse_nnodes("3") == (3, 3)
    for bad in ("0:2", "3:2", "a:b", "1:2:3", ""):
        with pytest.raises(ValueError, match="MIN:MAX"):
            parse_nnodes(bad)


def test_forms_at_max_at_once_and_below_max_after_the_settle_time():
    c = Cluster(Policy(2, 3, settle_s=2.0))
    c.beat(0, IDLE, -1)
    c.beat(1, IDLE, -1)
    assert plans(c.tick()) == []  # 2 of 3 nodes: wait for the third a little
    c.beat(2, IDLE, -1)
    (plan,) = plans(c.tick())
    assert plan[1] == 0 and plan[2]["members"] == [0, 1, 2] and plan[2]["master"] == ["10.0.0.0", 5000]
    c2 = Cluster(Policy(2, 3, settle_s=2.0))
    c2.beat(1, IDLE, -1)
    c2.beat(2, IDLE, -1)
    got = [plans(c2.tick()) for _ in range(5)]
    assert got[:3] == [[], [], []] and got[3][0][2]["members"] == [1, 2]
    assert got[3][0][2]["master"] == ["10.0.0.1", 5001]  # rank 0 on the lowest member


def _running(c: Cluster, nodes: list[int], gen: int) -> None:
    for n in nodes:
        c.beat(n, RUNNING, gen)


def test_a_silent_member_ends_the_generation_and_the_rest_re_form_then_it_rejoins():
    c = Cluster(Policy(2, 3, dead_after_s=5.0, settle_s=2.0))
    for n in range(3):
        c.beat(n, IDLE, -1)
    assert plans(c.tick())[0][2]["members"] == [0, 1, 2]
    _running(c, [0, 1, 2], 0)
    quiet = [c.tick(silent=(2,)) for _ in range(10)]  # 5 s without a beat from node 2: not yet
    assert all(a == [] for a in quiet)
    (stop,) = c.tick(silent=(2,))
    assert stop[:2] == ("stop", 0) and "node 2 stopped beating" in stop[2]
    c.beat(0, IDLE, 0)
    c.beat(1, IDLE, 0)
    got = [plans(c.tick(silent=(2,))) for _ in range(5)]
    formed = [p for p in got if p][0][0]
    assert formed[1] == 1 and formed[2]["members"] == [0, 1] and "node 2 stopped beating" in formed[2]["reason"]
    _running(c, [0, 1], 1)
    c.beat(2, IDLE, 1, agent="b")  # its launcher is back (a new agent id) and asks for generation 2
    (stop,) = c.tick()
    assert stop == ("stop", 1, "node 2 joined")
    c.beat(0, IDLE, 1)
    c.beat(1, IDLE, 1)
    (plan,) = plans(c.tick())
    assert plan[1] == 2 and plan[2]["members"] == [0, 1, 2] and plan[2]["reason"] == "node 2 joined"


def test_too_few_nodes_within_the_join_deadline_aborts_with_its_exit_code():
    c = Cluster(Policy(2, 3, join_timeout_s=3.0))
    c.beat(0, IDLE, -1)
    got = [plans(c.tick()) for _ in range(6)]
    assert got[:5] == [[]] * 5
    assert got[5][0][2]["code"] == EXIT_TOO_FEW and "only 1 node(s) [0]" in got[5][0][2]["abort"]
    assert c.tick() == []  # decided once


def test_a_failed_rank_restarts_the_same_nodes_until_max_restarts_then_aborts_with_its_code():
    c = Cluster(Policy(1, 2, max_restarts=1, settle_s=0.0))
    c.beat(0, IDLE, -1)
    c.beat(1, IDLE, -1)
    c.tick()
    for gen in (0, 1):
        _running(c, [0, 1], gen)
        c.beat(1, FAILED, gen, rank=0, code=7)
        assert c.tick() == [("stop", gen, "node 1: rank 0 exited with code 7")]
        c.beat(0, IDLE, gen)
        c.beat(1, IDLE, gen)
        (plan,) = plans(c.tick())
        if gen == 0:
            assert plan[2]["members"] == [0, 1] and "exited with code 7" in plan[2]["reason"]
    assert plan[2]["code"] == 7 and "no restarts left (1 of --max-restarts 1 used)" in plan[2]["abort"]


def test_a_rank_failing_because_a_node_vanished_is_not_a_failure_of_its_own():
    """Node 2 dies; node 0's rank gets PeerLost (exit 1) before node 2's silence is 5 s long."""
    c = Cluster(Policy(1, 3, max_restarts=0, dead_after_s=5.0, settle_s=0.0))
    for n in range(3):
        c.beat(n, IDLE, -1)
    c.tick()
    _running(c, [0, 1, 2], 0)
    c.tick()
    c.beat(0, FAILED, 0, rank=0, code=1)
    assert c.tick(silent=(2,)) == [("stop", 0, "node 0: rank 0 exited with code 1")]
    c.beat(0, IDLE, 0)
    c.beat(1, IDLE, 0)
    got = [c.tick(silent=(2,)) for _ in range(12)]
    (plan,) = plans(sum(got, []))
    assert plan[2]["members"] == [0, 1] and plan[2]["reason"].startswith("node 2 stopped beating"), plan
    assert sum(map(len, got[:8])) == 0  # it waited for node 2's silence to be conclusive


def test_members_that_finish_end_the_job_and_a_finishing_job_does_not_re_form():
    c = Cluster(Policy(1, 2))
    c.beat(0, IDLE, -1)
    c.beat(1, IDLE, -1)
    c.tick()
    _running(c, [0, 1], 0)
    c.beat(0, DONE, 0)
    assert c.tick() == []  # node 1 still running
    c.beat(1, DONE, 0)
    assert c.tick() == [("finish",)]
    c2 = Cluster(Policy(1, 2, dead_after_s=1.0))
    c2.beat(0, IDLE, -1)
    c2.beat(1, IDLE, -1)
    c2.tick()
    _running(c2, [0, 1], 0)
    c2.beat(0, DONE, 0)
    got = [c2.tick(silent=(1,)) for _ in range(4)]  # node 1 leaves after node 0 finished
    assert ("finish",) in sum(got, []) and not any(a[0] == "stop" for a in sum(got, []))


def test_a_rank_failing_after_another_node_finished_ends_the_job_with_its_code():
    """Node 0's ranks are done; node 1's rank then fails: nobody can re-run node 0's ranks, so
    the job ends with the failure's code (before: node 0 exited 0 after the join deadline, node 1 4,
    EXIT_LOST, after another)."""
    c = Cluster(Policy(1, 2, max_restarts=3))
    c.beat(0, IDLE, -1)
    c.beat(1, IDLE, -1)
    c.tick()
    _running(c, [0, 1], 0)
    c.beat(0, DONE, 0)
    assert c.tick() == []  # node 1 still running
    c.beat(1, FAILED, 0, rank=0, code=7)
    (plan,) = plans(c.tick())
    assert plan[1] == 1 and plan[2]["code"] == 7, plan
    assert "node 1: rank 0 exited with code 7 after node(s) [0] had finished" in plan[2]["abort"]
    assert c.tick() == []


def test_a_replaced_launcher_that_wakes_is_not_heard():
    """Node 1's launcher freezes, the generation re-forms without it, a new launcher of node 1
    (start 2) joins; the old one (start 1) wakes and beats again: its beats must not count (they
    kept node 1 alive after its new launcher died)."""
    c = Cluster(Policy(1, 2, settle_s=0.0))
    c.beat(0, IDLE, -1)
    c.beat(1, IDLE, -1, start=1)
    c.tick()
    c.beat(0, RUNNING, 0)
    c.beat(1, RUNNING, 0, start=1)
    got = sum((c.tick(silent=(1,)) for _ in range(12)), [])
    assert got[0][:2] == ("stop", 0) and "node 1 stopped beating" in got[0][2]
    c.beat(0, IDLE, 0)
    (plan,) = plans(c.tick(silent=(1,)))
    assert plan[2]["members"] == [0]
    _running(c, [0], 1)
    c.beat(1, IDLE, 0, agent="b", start=2)  # the new launcher
    assert c.tick()[0] == ("stop", 1, "node 1 joined")
    c.beat(0, IDLE, 1)
    (plan,) = plans(c.tick())
    assert plan[2]["members"] == [0, 1]
    c.beat(0, RUNNING, 2)
    c.beat(1, RUNNING, 2, agent="b", start=2)
    c.tick()
    c.beat(1, IDLE, 0, agent="a", start=1)  # the old one wakes and beats; the new one dies
    got = sum((c.tick() for _ in range(12)), [])  # (Cluster.tick beats again as the last beat: the old one)
    assert got and got[0][:2] == ("stop", 2) and "node 1 stopped beating" in got[0][2], got


class Refusing:
    """A rendezvous client whose store refuses every request at once (node 0's launcher came back
    with another store: every request names the old one's incarnation)."""

    def __init__(self):
        self.calls = 0

    def _refuse(self, *args, **kw):
        self.calls += 1
        raise RendezvousError("rendezvous store refused wait: request for store incarnation 1, this is 2")

    wait = mget = _refuse


def test_a_refusing_rendezvous_is_retried_at_the_beat_not_in_a_busy_loop():
    client = Refusing()
    beater = type("B", (), {"lost_since": time.monotonic(), "node": 1, "state": {}})()
    got = elastic_agent._await_plan(client, beater, 3, Policy(1, 2, join_timeout_s=0.5), None)
    assert got.code == EXIT_LOST and "refused" in got.why
    assert client.calls <= 10, f"{client.calls} requests in 0.5 s"
    client.calls = 0
    with pytest.raises(RendezvousError):
        elastic_agent._latest(client, Policy(1, 2, join_timeout_s=0.5))
    assert client.calls <= 10, f"{client.calls} requests in 0.5 s"


def test_a_member_finishing_just_after_another_failed_ends_the_job_with_the_failure():
    """The failure is seen first (the generation ends), then node 0's DONE: the job ends with the
    rank's code, not a restart of node 1 alone after the join deadline (node 0 stayed busy)."""
    c = Cluster(Policy(1, 2, max_restarts=3, join_timeout_s=10.0))
    c.beat(0, IDLE, -1)
    c.beat(1, IDLE, -1)
    c.tick()
    _running(c, [0, 1], 0)
    c.beat(1, FAILED, 0, rank=0, code=7)
    assert c.tick() == [("stop", 0, "node 1: rank 0 exited with code 7")]
    c.beat(0, DONE, 0)
    c.beat(1, IDLE, 0)
    (plan,) = plans(c.tick())
    assert plan[1] == 1 and plan[2]["code"] == 7 and "as node(s) [0] finished" in plan[2]["abort"], plan


class FakeStore:
    """Node 0's store as the coordinator and an agent use it, in one process; it keeps answering.
    ``ticking``: mget of "coordinator" shows a new value each time (a live coordinator)."""

    def __init__(self, ticking: bool = False):
        self.data, self.ticking, self.ticks = {}, ticking, 0

    def mget(self, keys):
        if self.ticking:
            self.ticks += 1
            self.data["coordinator"] = str(self.ticks).encode()
        return [self.data.get(k) for k in keys]

    def set(self, key, value):
        self.data[key] = value

    def wait(self, keys, abort, timeout_s):
        time.sleep(min(timeout_s, 0.02))
        if abort in self.data:
            return [ABORT, self.data[abort]]
        values = [self.data.get(k) for k in keys]
        return [OK, values] if all(v is not None for v in values) else [TIMEOUT, keys]


def _idle_beat(node: int) -> bytes:
    return pack({"id": f"a{node}", "seq": 1, "state": IDLE, "gen": -1, "addr": "127.0.0.1", "port": 1, "start": 1})


def _until(cond, within_s: float = 3.0) -> bool:
    end = time.monotonic() + within_s
    while not cond() and time.monotonic() < end:
        time.sleep(0.02)
    return cond()


def test_a_coordinator_that_fails_ends_the_running_generation_and_the_job_saying_why():
    """An unreadable beat (another version's, a corrupted write) raised out of the coordinator's
    thread: it died silently, node 0's store kept answering, and every agent waited for ever."""
    store = FakeStore()
    store.set("beat/0", _idle_beat(0))
    coord = Coordinator(store, Policy(1, 2, settle_s=0.1), lambda line: None)
    try:
        assert _until(lambda: "plan/0" in store.data)
        store.set("beat/1", b"\xc1")  # not msgpack
        assert _until(lambda: "plan/1" in store.data), store.data
    finally:
        coord.close()
    assert b"coordinator failed" in store.data["stop/0"]
    beater = type("B", (), {"lost_since": None, "node": 0, "state": {"start": 1}})()
    g, plan = elastic_agent._await_plan(store, beater, 1, Policy(1, 2), None)
    assert g == 1 and plan["code"] == EXIT_LOST and "coordinator failed" in plan["abort"], plan


def test_an_agent_gives_up_on_a_coordinator_that_stands_still_but_waits_on_a_live_one():
    beater = type("B", (), {"lost_since": None, "node": 1, "state": {"start": 1}})()
    policy = Policy(1, 2, join_timeout_s=0.4, settle_s=0.1)
    t0 = time.monotonic()
    got = elastic_agent._await_plan(FakeStore(), beater, 0, policy, None)
    assert got.code == EXIT_LOST and "not ticked" in got.why and time.monotonic() - t0 < 2.0, got
    # a node beyond MAX waits for as long as a generation runs: a live coordinator is no reason to leave
    got = elastic_agent._await_plan(FakeStore(ticking=True), beater, 0, policy, time.monotonic() + 1.0)
    assert got.code == 124, got
