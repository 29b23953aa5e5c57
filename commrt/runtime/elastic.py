"""Elastic rendezvous across nodes (issue 33 item 1): who is in the job, generation by generation.

``commrt launch --nnodes MIN:MAX`` runs one agent per node (``elastic_agent.py``). The launcher
of node 0 also serves a bootstrap store (``store.StoreServer``, authenticated like every commrt
store) on the stable MASTER_PORT, which outlives every generation's ranks, and runs a
``Coordinator`` over it. The ranks of a generation meet on a port of their own, picked by the
node that holds their rank 0.

The protocol is a handful of keys:

- ``beat/<node>``: each agent's heartbeat, rewritten every ``BEAT_S`` (state, generation,
  address and port for a rank 0, a per-agent id, its ``start`` and a sequence number).
- ``agent/<node>``: a counter of the node's launcher starts; a launcher whose start is no longer
  the newest (replaced while frozen or cut off) stops its ranks and leaves (``EXIT_REPLACED``),
  and the coordinator ignores its beats. A node whose beat has not
  changed for ``dead_after_s`` is gone: its launcher was killed, its host died or its link is down.
- ``plan/<g>``: generation ``g``: the member nodes in rank order, where rank 0 meets, and why it
  was formed; or an abort (too few nodes, too many failures, or a rank that failed after another
  node's had finished) with the exit code to end with.
- ``stop/<g>``: why generation ``g`` ends: every member stops its ranks and asks for ``g + 1``.
- ``latest``: the newest plan, so an agent that (re)starts asks for the one after it.
- ``finished``: every member's ranks exited 0; agents end.
- ``coordinator``: a counter node 0's coordinator bumps every tick; an agent waiting for a plan
  while it stands still for the join deadline ends (``EXIT_LOST``) instead of waiting for ever.

``Membership`` is the decision logic, pure (time and beats in, actions out) so that it is tested
without sockets; the ``Coordinator`` thread feeds it from the store and writes its decisions.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Callable

import msgpack

from commrt.runtime.errors import RendezvousError

log = logging.getLogger(__name__)

BEAT_S = 0.5
DEAD_AFTER_S = 5.0  # ten missed beats: a loaded host is slow, not dead
SETTLE_S = 2.0  # below MAX nodes: how long a forming generation waits for more to arrive
EXIT_TOO_FEW = 3  # fewer than MIN nodes came within the join deadline
EXIT_LOST = 4  # this node could not reach the rendezvous (node 0) within the join deadline
EXIT_REPLACED = 5  # a newer launcher of this node id joined while this one was frozen or cut off

IDLE, RUNNING, FAILED, DONE = "idle", "running", "failed", "done"


def parse_nnodes(spec: str) -> tuple[int, int]:
    """``"2:4"`` -> (2, 4); ``"3"`` -> (3, 3). A ValueError says what a valid one looks like."""
    parts = spec.split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) in (1, 2) else (0, 0)
    except ValueError:
        lo = hi = 0
    if not 1 <= lo <= hi:
        raise ValueError(f"--nnodes {spec!r} is invalid; valid: N or MIN:MAX with 1 <= MIN <= MAX")
    return lo, hi


@dataclasses.dataclass(frozen=True)
class Policy:
    min_nodes: int
    max_nodes: int
    join_timeout_s: float = 120.0
    """A forming generation with fewer than MIN nodes after this long aborts the job."""
    dead_after_s: float = DEAD_AFTER_S
    settle_s: float = SETTLE_S
    max_restarts: int = 0
    """Generations ended by a failed rank (a node lost or joined does not count)."""


@dataclasses.dataclass
class _Seen:
    beat: dict
    changed: float


class Membership:
    """The coordinator's decisions. ``tick(now, beats)`` -> actions, each one of
    ``("stop", g, reason)``, ``("plan", g, plan)``, ``("finish",)``. A plan is a dict:
    ``members`` (node ids in rank order), ``master`` [addr, port], ``reason``; or ``abort``
    (a message) and ``code``."""

    def __init__(self, policy: Policy, now: float):
        self.policy = policy
        self.gen, self.members, self.running = -1, [], False
        self.forming_since, self.reason = now, "the job starts"
        self.failures, self.finished = 0, False
        self.failed: tuple[str, int] | None = None  # a failed rank ended the last generation
        self.last_members: list[int] = []
        self.seen: dict[int, _Seen] = {}

    def _observe(self, now: float, beats: dict[int, dict | None]) -> None:
        for node, beat in beats.items():
            if beat is None:
                continue
            old = self.seen.get(node)
            if old is not None and beat.get("start", 0) < old.beat.get("start", 0):
                continue  # a replaced launcher of this node woke (it leaves: elastic_agent.replaced)
            if old is None or (old.beat.get("id"), old.beat.get("seq")) != (beat.get("id"), beat.get("seq")):
                self.seen[node] = _Seen(beat, now)

    def alive(self, node: int, now: float) -> bool:
        s = self.seen.get(node)
        return s is not None and now - s.changed <= self.policy.dead_after_s

    def _state(self, node: int) -> tuple[str, int]:
        b = self.seen[node].beat
        return b.get("state"), b.get("gen", -1)

    def tick(self, now: float, beats: dict[int, dict | None]) -> list[tuple]:
        if self.finished:
            return []
        self._observe(now, beats)
        return self._while_running(now) if self.running else self._while_forming(now)

    def _while_running(self, now: float) -> list[tuple]:
        g = self.gen
        done = [n for n in self.members if self.alive(n, now) and self._state(n) == (DONE, g)]
        if done:  # the job is ending: members finish or vanish, nobody re-forms
            failed = [n for n in self.members if self.alive(n, now) and self._state(n) == (FAILED, g)]
            if failed:  # ... or fail: the job ends with the rank's code (the finished cannot run again)
                self.finished = True
                b = self.seen[failed[0]].beat
                return [("plan", g + 1, {"abort": f"node {failed[0]}: rank {b.get('rank')} exited with code "
                                         f"{b.get('code')} after node(s) {done} had finished",
                                         "code": int(b.get("code") or 1)})]
            if all(n in done or not self.alive(n, now) for n in self.members):
                self.finished = True
                return [("finish",)]
            return []
        reason, code = self._why_stop(now)
        if reason is None:
            return []
        self.running, self.forming_since, self.reason = False, now, reason
        self.failed, self.last_members = ((reason, code) if code is not None else None), self.members
        return [("stop", g, reason)]

    def _why_stop(self, now: float) -> tuple[str | None, int | None]:
        g = self.gen
        for n in self.members:
            if not self.alive(n, now):
                last = self.seen[n].changed
                return f"node {n} stopped beating ({now - last:.1f}s since its last heartbeat)", None
        for n in self.members:
            state, gen = self._state(n)
            b = self.seen[n].beat
            if state == FAILED and gen == g:
                return f"node {n}: rank {b.get('rank')} exited with code {b.get('code')}", int(b.get("code") or 1)
            if state == IDLE and gen >= g:  # a restarted agent holds no ranks of this generation
                return f"node {n} restarted (its launcher asks for generation {gen + 1})", None
        if len(self.members) < self.policy.max_nodes:
            joined = [n for n in self._ready(now) if n not in self.members]
            if joined:
                return f"node {joined[0]} joined", None
        return None, None

    def _ready(self, now: float) -> list[int]:
        return sorted(n for n in self.seen if self.alive(n, now) and self._state(n)[0] == IDLE)

    def _while_forming(self, now: float) -> list[tuple]:
        p, waited = self.policy, now - self.forming_since
        done = [n for n in self.last_members if self.alive(n, now) and self._state(n) == (DONE, self.gen)]
        if done and self.failed is not None:  # a member's ranks finished as another's failed: the
            self.finished = True  # job ends with the failure (the finished cannot run again)
            return [("plan", self.gen + 1, {"abort": f"{self.failed[0]}, as node(s) {done} finished",
                                            "code": self.failed[1]})]
        ready = self._ready(now)
        busy = [n for n in self.seen if self.alive(n, now) and n not in ready]  # still stopping ranks
        enough = len(ready) >= p.min_nodes
        if enough and ((not busy and (len(ready) >= p.max_nodes or waited >= p.settle_s)) or waited >= p.join_timeout_s):
            abort = self._count_failure(now)
            return [abort] if abort else [self._form(now, ready[:p.max_nodes])]
        if waited >= p.join_timeout_s:
            self.finished = True
            return [("plan", self.gen + 1, {"abort": f"only {len(ready)} node(s) {ready} ready within "
                                            f"{p.join_timeout_s:g}s; --nnodes needs at least {p.min_nodes} "
                                            f"(last change: {self.reason})", "code": EXIT_TOO_FEW})]
        return []

    def _count_failure(self, now: float) -> tuple | None:
        """A failed rank ended the generation: a restart, unless a member of it has vanished
        meanwhile (its loss made the others' collectives fail: PeerLost comes within a heartbeat
        or two, before its silence is DEAD_AFTER_S long; forming waits for that, as the vanished
        node counts as busy until then). The abort plan when no restarts are left."""
        failed, self.failed = self.failed, None
        if failed is None:
            return None
        lost = [n for n in self.last_members if not self.alive(n, now)]
        if lost:
            self.reason = f"node {lost[0]} stopped beating (after it, {failed[0]})"
            return None
        self.failures += 1
        if self.failures <= self.policy.max_restarts:
            return None
        self.finished = True
        return ("plan", self.gen + 1, {"abort": f"{failed[0]}; no restarts left ({self.failures - 1} of "
                                       f"--max-restarts {self.policy.max_restarts} used)", "code": failed[1]})

    def _form(self, now: float, members: list[int]) -> tuple:
        self.gen += 1
        self.members, self.running = members, True
        head = self.seen[members[0]].beat
        return ("plan", self.gen, {"gen": self.gen, "members": members, "master": [head["addr"], head["port"]],
                                   "reason": self.reason, "formed_in_s": round(now - self.forming_since, 3)})


def pack(value) -> bytes:
    return msgpack.packb(value)


def unpack(raw) -> dict:
    return msgpack.unpackb(bytes(raw))


class Coordinator:
    """Node 0's thread: every ``BEAT_S`` reads the beats of nodes 0..MAX-1, asks ``Membership``
    and writes what it decided; ``say`` reports each decision (the launcher's log)."""

    def __init__(self, client, policy: Policy, say: Callable[[str], None]):
        self.client, self.say = client, say
        self.membership = Membership(policy, time.monotonic())
        self.written, self.ended = -1, False  # the newest plan written; a finish or abort written
        self._quit = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="commrt-elastic-coordinator", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        """Tick until closed. Anything unexpected (a bug, a beat it cannot read) ends the job
        with EXIT_LOST, saying why: a silently dead thread left every agent waiting for ever on a
        store that still answers."""
        try:
            self._ticks()
        except Exception as exc:
            log.exception("elastic coordinator failed")
            detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            self._abort(f"node 0's elastic coordinator failed: {detail}")

    def _ticks(self) -> None:
        nodes = list(range(self.membership.policy.max_nodes))
        keys = [f"beat/{n}" for n in nodes]
        count = 0
        while not self._quit.wait(BEAT_S / 2):
            count += 1
            try:
                self.client.set("coordinator", str(count).encode())  # agents see it is alive
                raw = self.client.mget(keys)
            except RendezvousError as exc:  # its own store, in this process: an overloaded host
                log.warning("elastic coordinator: %s; trying again", exc)
                continue
            beats = {n: (unpack(v) if v is not None else None) for n, v in zip(nodes, raw)}
            for action in self.membership.tick(time.monotonic(), beats):
                self._apply_surely(action)

    def _abort(self, why: str) -> None:
        """End the job from a coordinator that cannot go on: the running generation stops, and
        the plan after the newest one written is an abort, which every agent waits for."""
        if self.ended:
            return
        self.membership.finished = True
        try:
            if self.written >= 0:
                self._apply_surely(("stop", self.written, why))
            self._apply_surely(("plan", self.written + 1, {"abort": why, "code": EXIT_LOST}))
        except Exception:  # the agents' own deadline (elastic_agent._await_plan) ends them
            log.exception("elastic coordinator: the abort could not be written either")

    def _apply_surely(self, action: tuple) -> None:
        """A decision is taken once: write it until the store takes it (or the launcher ends)."""
        while True:
            try:
                self._apply(action)
                return
            except RendezvousError as exc:
                log.warning("elastic coordinator: %s; writing %s again", exc, action[0])
                if self._quit.wait(BEAT_S):
                    return

    def _apply(self, action: tuple) -> None:
        if action[0] == "stop":
            _, g, reason = action
            self.say(f"generation {g} ends: {reason}")
            self.client.set(f"stop/{g}", reason.encode())
        elif action[0] == "plan":
            _, g, plan = action
            if "abort" in plan:
                self.say(f"the job ends (exit code {plan['code']}): {plan['abort']}")
            else:
                m = plan["members"]
                self.say(f"generation {g}: nodes {m} ({len(m)} of {self.membership.policy.max_nodes}), rank 0 at "
                         f"{plan['master'][0]}:{plan['master'][1]}, formed in {plan['formed_in_s']:g}s "
                         f"({plan['reason']})")
            self.client.set(f"plan/{g}", pack(plan))
            self.client.set("latest", str(g).encode())
            self.written, self.ended = g, "abort" in plan
        elif action[0] == "finish":
            self.say(f"generation {self.membership.gen} finished on every node")
            self.client.set("finished", b"1")
            self.ended = True

    def close(self) -> None:
        self._quit.set()
        self._thread.join(5.0)
