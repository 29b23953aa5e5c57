"""Who a shard counts: its members, workers that join a running job, and the worker-loss policy.

The members are the workers a shard counts: a sync step averages their pushes, the SSP bound is
measured from the slowest of them, a stuck request blames them. They start as the configured
initial membership, workers ``0 .. [ps] initial_workers - 1`` (all of them by default), the same
set on every shard whatever the order in which inits, pulls and pushes arrive: a member is never
"late", its clock starts at 0 and the others wait for it as the mode says. A worker leaves the
members when a shard drops it (``tick``: silent for ``worker_timeout_s`` under ``on_worker_loss =
"continue"``; ``error`` instead names it in a LOST reply to everyone waiting).

Joining a running job (issue 33 item 3). A worker that is not a member (a late joiner, id >=
initial_workers, or a dropped one that was restarted) joins in two rounds, so that every shard
admits it at the same step however their states differ when its requests arrive:

1. ``init`` changes no membership: each shard k answers ``[version, clock_k, member_k, start_k]``;
   ``start_k`` is its own clock there for a member, else ``max(own clock, the furthest member's
   clock)``: the running step, at which it holds nobody back.
2. If some shard said "not a member", the client sends ``JOIN`` at ``S = max_k start_k`` to every
   shard; a shard makes it a member at ``max(own clock, S)``, which is S (S >= every own clock_k),
   so all shards agree. JOIN is idempotent (a re-send after a server restart is harmless).

Interleavings. Between the rounds it is not a member anywhere it was not one before, so nothing
waits for it and no push of it is accepted there; a worker that dies between them has changed
nothing. Pushes of others applied meanwhile only raise the members' clocks: S may then lie below
the furthest member on a shard (never below its own clock), which makes it a slower member there
and the mode's rule (SSP bound, parked pushes) holds as for any member. A worker dropped on one
shard but not another is admitted on both at S (on the latter its clock only moves forward). A
member that restarts without being dropped is a member everywhere: no JOIN, it resumes at the
lowest of its clocks (a push that reached only some shards is re-sent: a duplicate there).
Sync mode admits nobody after the start (every step averages the same members): a dropped
worker's init is refused, and [ps] initial_workers is a config error there.
"""
from __future__ import annotations

import logging

from commrt.ps import protocol as P
from commrt.ps.parked import Parked, Waiting
from commrt.ps.recovery import StorageFailed
from commrt.ps.state import MAX_AHEAD, ShardState
from commrt.runtime.config import PsConfig
from commrt.runtime.errors import ProtocolError

log = logging.getLogger("commrt.ps.core")


def starting_step(init_replies: list[list]) -> tuple[bool, int]:
    """The client's half of the rule, from every shard's init reply ``[version, clock, member,
    start]``: (whether it must JOIN, the step it starts at)."""
    if all(body[2] for body in init_replies):
        return False, min(body[1] for body in init_replies)
    return True, max(body[3] for body in init_replies)


class Membership:
    """Mixed into ``ServerCore`` (uses its cfg, index, state, waiting, pushes, _log, _progress,
    _refuse and _fail)."""

    cfg: PsConfig
    index: int
    state: ShardState
    waiting: Waiting

    def tick(self, now: float) -> list[P.Routed]:
        """Apply the worker-loss policy to anything parked for longer than worker_timeout_s."""
        stuck = self.waiting.older_than(now - self.cfg.worker_timeout_s)
        if not stuck or self.failure is not None:
            return []
        out: list[P.Routed] = []  # filled as it goes: a failed write keeps the answers made before it
        try:
            return self._on_stuck(stuck, now, out)
        except StorageFailed as exc:
            return out + self._fail(str(exc), out)

    def _on_stuck(self, stuck: list[Parked], now: float, out: list[P.Routed]) -> list[P.Routed]:
        missing = self._laggards(stuck)
        if self.cfg.on_worker_loss == "continue" and missing and self.state.initialized:
            log.warning("server %d: dropping worker(s) %s (silent for %gs); continuing without them",
                        self.index, missing, self.cfg.worker_timeout_s)
            self.state.dropped.update(missing)
            self._log({"k": "d", "w": missing}, [])
            out += [self._refuse(p, "was dropped after it went silent") for p in self.waiting.all()
                    if p.req.worker in self.state.dropped]
            return self._progress(now, out)
        if self.cfg.mode == "sync" and any(p.grads is not None for p in stuck):
            # the step cannot complete now: answer all of its pushes at once, naming the same workers
            # (a push answered a tick before another would be named as missing by the later one)
            stuck += [p for (_, step), p in self.pushes.items() if step == self.state.version and p not in stuck]
        named = f"{missing}" if len(missing) <= 32 else f"{missing[:32]} and {len(missing) - 32} more"
        for p in stuck:
            msg = (f"server {self.index}: {P.OP_NAMES[p.req.op]} step {p.req.step} of worker "
                   f"{p.req.worker} waited {self.cfg.worker_timeout_s:g}s for worker(s) {named}")
            out.append(P.routed(p.ident, P.LOST, p.req.req_id, [msg, missing]))
            self.waiting.remove(p)
        return out

    def _laggards(self, stuck: list[Parked]) -> list[int]:
        """The workers the stuck requests are waiting for."""
        if any(p.req.op == P.INIT for p in stuck):
            return [0]  # the seeding worker
        if self.cfg.mode == "sync" and any(p.grads is not None for p in stuck):
            return [w for w in self.state.active() if (w, self.state.version) not in self.pushes]
        bound = self.cfg.staleness if self.cfg.mode == "ssp" else 0
        blamed: set[int] = set()
        for p in stuck:
            if p.grads is not None and p.req.step > self.state.clocks[p.req.worker]:
                blamed.add(p.req.worker)  # it waits for its own earlier step first, nobody else
            elif self.cfg.mode != "async":  # async waits for nobody else
                need = (p.req.step if p.grads is not None else p.clock) - bound
                blamed.update(w for w in self.state.active() if self.state.clocks[w] < need)
        return sorted(blamed)


    # -- joining a running job (see the module docstring) ----------------------------------
    def _membership(self, worker: int) -> list:
        """The end of an init reply: [member, start]."""
        st = self.state
        if worker in st.active():
            return [True, st.clocks[worker]]
        running = max((st.clocks[w] for w in st.active()), default=0)
        return [False, max(st.clocks[worker], running)]

    def _unwelcome(self, worker: int) -> str | None:
        """Why an init of ``worker`` is refused here for its membership (None: it is not)."""
        if self.cfg.mode == "sync" and worker in self.state.dropped:
            return (f"worker {worker} was dropped after it went silent, and a sync job admits no worker "
                    "after it began (every step averages the same workers): restart the job (from the "
                    "servers' checkpoint), or use mode async or ssp, where it rejoins at the running step")
        return None

    def _admit(self, ident: bytes, req: P.Request) -> list[P.Routed]:
        """The JOIN's answer, after the refusals of what an earlier life of the worker left parked."""
        w, at, st = req.worker, req.step, self.state
        out = []
        if self.cfg.mode == "sync":
            raise ProtocolError(f"worker {w} cannot join a sync job at step {at}: it admits no worker after "
                                "it began (every step averages the same workers)")
        top = max(st.clocks)
        if at > top + MAX_AHEAD:
            raise ProtocolError(f"worker {w} asks to join at step {at}, beyond any worker's step here ({top})")
        clock = max(st.clocks[w], at)
        if w not in st.active() or clock != st.clocks[w]:
            st.admit(w, clock)
            self._log({"k": "a", "w": w, "c": clock}, [])
            log.info("server %d: worker %d joins at step %d (version %d)", self.index, w, clock, st.version)
            # what an earlier life of it left parked here can never be applied now
            for p in self.waiting.all():
                if p.req.worker == w and p.req.step < clock and p.req.op != P.INIT:
                    out.append(self._refuse(p, f"rejoined at step {clock}: its request for step {p.req.step} is void"))
        return out + [P.routed(ident, P.OK, req.req_id, [st.version, clock])]
