"""One node's elastic agent (issue 33 item 1): beat, wait for a generation that includes this
node, run its ranks, and stop them when the generation ends (``elastic.py`` has the protocol).

The launcher gives ``run_node`` a ``start(plan, index)`` that starts this node's ranks of a
generation (RANK, WORLD_SIZE, MASTER_* and COMMRT_ELASTIC_GENERATION from the plan) and returns
their processes. Every wait has a deadline: a plan within the join deadline, a stop within the
grace of ``processes._stop_everything``, the rendezvous within the join deadline after it stops
answering (then the node ends with ``EXIT_LOST``).
"""
from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import Callable, Sequence

from commrt.runtime.elastic import (BEAT_S, DONE, EXIT_LOST, EXIT_REPLACED, FAILED, IDLE, RUNNING, Policy, pack,
                                    unpack)
from commrt.runtime.errors import RendezvousError
from commrt.runtime.processes import _status, _stop_everything
from commrt.runtime.store_core import ABORT, OK

RETRY_S = BEAT_S / 5  # between store requests that failed at once


@dataclasses.dataclass
class Outcome:
    code: int
    why: str
    generations: list = dataclasses.field(default_factory=list)
    """(generation, members, reason) of every generation this node ran ranks in."""


class Beater:
    """Rewrites ``beat/<node>`` every BEAT_S on its own store client, so a node that is busy
    stopping its ranks still counts as present. ``lost_since``: when the store stopped answering."""

    def __init__(self, client, node: int, addr: str, pick_port: Callable[[], int]):
        self.client, self.node, self.pick_port = client, node, pick_port
        self.state = {"id": os.urandom(6).hex(), "seq": 0, "state": IDLE, "gen": -1, "addr": addr, "port": 0}
        self.lost_since: float | None = None
        self._lock, self._quit = threading.Lock(), threading.Event()
        self._thread = threading.Thread(target=self._loop, name="commrt-elastic-beat", daemon=True)
        self._thread.start()

    def set(self, **fields) -> None:
        with self._lock:
            self.state.update(fields)
        self._beat()

    def _beat(self) -> None:
        with self._lock:
            self.state["seq"] += 1
            raw = pack(self.state)
        try:
            self.client.set(f"beat/{self.node}", raw)
            self.lost_since = None
        except RendezvousError:
            self.lost_since = self.lost_since or time.monotonic()

    def _loop(self) -> None:
        while not self._quit.wait(BEAT_S):
            self._beat()

    def close(self) -> None:
        self._quit.set()
        self._thread.join(5.0)


def run_node(client, beater: Beater, policy: Policy, start: Callable[[dict, int], Sequence],
             say: Callable[[str], None], timeout_s: float | None = None) -> Outcome:
    """Take part in generations until the job finishes or aborts; the node's exit code and why."""
    out = Outcome(0, "")
    end = None if timeout_s is None else time.monotonic() + timeout_s
    latest = _latest(client, policy)
    want = latest + 1
    beater.set(start=client.add(f"agent/{beater.node}", 1))
    while True:
        # a fresh port for each generation's rank 0: the last one's may still be closing
        beater.set(state=IDLE, gen=want - 1, rank=None, code=None, port=beater.pick_port())
        got = _await_plan(client, beater, want, policy, end)
        if isinstance(got, Outcome):
            got.generations = out.generations
            return got
        g, plan = got
        if "abort" in plan:
            return Outcome(int(plan["code"]), plan["abort"], out.generations)
        want = g + 1
        if beater.node not in plan["members"]:
            say(f"generation {g} formed without this node ({plan['members']}); asking for {want}")
            continue
        index = plan["members"].index(beater.node)
        out.generations.append((g, plan["members"], plan["reason"]))
        procs = start(plan, index)
        beater.set(state=RUNNING, gen=g)
        ended = _watch(client, beater, g, procs, policy, end, say)
        if ended is not None:
            ended.generations = out.generations
            return ended


def _latest(client, policy: Policy) -> int:
    deadline = time.monotonic() + policy.join_timeout_s
    while True:
        try:
            raw = client.mget(["latest"])[0]
            return -1 if raw is None else int(bytes(raw))
        except RendezvousError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(RETRY_S)


def _await_plan(client, beater: Beater, g: int, policy: Policy, end: float | None):
    """(g, plan), or an Outcome: finished, the job's timeout, or the rendezvous lost for good.
    The coordinator forms or aborts a generation within its join deadline, and a store that
    stops answering ends the wait after the same time; a store that answers while node 0's
    coordinator stands still (its thread dead) ends it too. A plan itself may be long in coming:
    a node beyond MAX waits while a generation runs."""
    alive = _CoordinatorWatch(policy)
    while True:
        now = time.monotonic()
        if end is not None and now >= end:
            return Outcome(124, "the launch's --timeout passed while waiting for a generation")
        try:
            status, value = client.wait([f"plan/{g}"], "finished", BEAT_S)
            newest, tick = client.mget([f"agent/{beater.node}", "coordinator"])
        except RendezvousError as exc:
            if beater.lost_since is not None and now - beater.lost_since > policy.join_timeout_s:
                return Outcome(EXIT_LOST, f"lost the rendezvous: {exc}")
            time.sleep(RETRY_S)  # a store that refuses (node 0 restarted: another incarnation) answers at once
            continue
        if newest is not None and int(newest) > beater.state.get("start", 0):
            return Outcome(EXIT_REPLACED, _replaced_why(beater, int(newest)))
        if status == ABORT:
            return Outcome(0, "the job finished")
        if status == OK:
            return g, unpack(value[0])
        if alive.stalled(tick):
            return Outcome(EXIT_LOST, f"node 0's elastic coordinator has not ticked for {alive.limit_s:g}s "
                           "while its store answers (its thread died: see node 0's log); giving up")


class _CoordinatorWatch:
    """Whether node 0's coordinator has stood still for the join deadline plus the settle
    time: its ``coordinator`` counter unchanged (or never seen) for that long."""

    def __init__(self, policy: Policy):
        self.limit_s = policy.join_timeout_s + policy.settle_s
        self.last, self.since = None, time.monotonic()

    def stalled(self, tick) -> bool:
        now = time.monotonic()
        if tick is not None and bytes(tick) != self.last:
            self.last, self.since = bytes(tick), now
        return now - self.since > self.limit_s


def _watch(client, beater: Beater, g: int, procs: Sequence, policy: Policy, end: float | None,
           say: Callable[[str], None]) -> Outcome | None:
    """Until generation ``g`` ends here: None to ask for the next one, or the node's Outcome."""
    next_check = 0.0
    while True:
        # _status does not reap: _stop_everything can still stop what a crashed rank left running
        failed = [(i, rc) for i, p in enumerate(procs) if (rc := _status(p)) not in (None, 0)]
        if failed:
            i, rc = failed[0]
            code = 128 - rc if rc < 0 else rc
            _stop_everything(procs)
            say(f"generation {g}: local rank {i} exited with code {code}; stopped this node's ranks")
            beater.set(state=FAILED, gen=g, rank=i, code=code)
            _await_stop(client, g, policy)
            return None
        if all(_status(p) is not None for p in procs):
            beater.set(state=DONE, gen=g)
            return _await_finish(client, g, policy)
        now = time.monotonic()
        if end is not None and now >= end:
            _stop_everything(procs)
            return Outcome(124, "the launch's --timeout passed")
        if beater.lost_since is not None and now - beater.lost_since > policy.dead_after_s:
            _stop_everything(procs)
            say(f"generation {g}: the rendezvous has not answered for {policy.dead_after_s:g}s (node 0 "
                "gone, or this node's link down); stopped this node's ranks")
            return None
        if now >= next_check:
            next_check = now + BEAT_S
            try:
                reason, newest = client.mget([f"stop/{g}", f"agent/{beater.node}"])
            except RendezvousError:
                reason = newest = None  # the beater counts how long the store has been gone
            if newest is not None and int(newest) > beater.state.get("start", 0):
                _stop_everything(procs)
                return Outcome(EXIT_REPLACED, _replaced_why(beater, int(newest)))
            if reason is not None:
                say(f"generation {g} ends: {bytes(reason).decode(errors='replace')}; stopping this node's ranks")
                _stop_everything(procs)
                return None
        time.sleep(0.05)


def _replaced_why(beater: Beater, newest: int) -> str:
    return (f"replaced: launcher start {newest} of node {beater.node} joined while this one (start "
            f"{beater.state.get('start')}) was not answering; this one leaves")


def _await_stop(client, g: int, policy: Policy) -> None:
    """The coordinator has seen our failure once it ends the generation, or the job (plan
    ``g + 1``, an abort, when another node had finished: node 0 may leave soon after). Bounded."""
    try:
        client.wait([f"plan/{g + 1}"], f"stop/{g}", policy.dead_after_s + policy.settle_s)
    except RendezvousError:
        pass


def _await_finish(client, g: int, policy: Policy) -> Outcome:
    """Our ranks are done; node 0 announces when every node's are, or ends the job when another
    node's rank failed meanwhile (plan ``g + 1`` is then an abort with its code). Bounded: ours
    are done either way."""
    finished = Outcome(0, f"generation {g} finished")
    try:
        status, value = client.wait([f"plan/{g + 1}"], "finished", policy.join_timeout_s)
    except RendezvousError:
        return finished
    plan = unpack(value[0]) if status == OK else {}
    return Outcome(int(plan["code"]), plan["abort"]) if "abort" in plan else finished
