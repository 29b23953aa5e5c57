"""A server shard's request logic, without sockets: frames in, replies out.

``handle(ident, frames, now)`` and ``tick(now)`` return the replies to send. Requests that must
wait (a sync step not yet complete, an SSP worker too far ahead, a pull for a version not yet
reached, an init before the seed) are parked (``parked.Waiting``) and answered by a later call.
Every request is validated completely before anything changes, so a bad one gets an error reply
and leaves the state as it was.

Exactly-once: a push is identified by (worker, step). Each worker's steps are applied in order;
a re-sent push that was already applied is acknowledged as a duplicate, never applied twice;
a push is acknowledged only after it was applied (and logged, when durable).

Binding (``binding``): the seed's init fixes the description (segments, dtypes, full shapes);
every other init is compared with it; only workers whose init matched may push or pull.
A durable write that fails (a full disk) stops the shard: every waiting worker, and every later
request, gets a FAILED reply naming the cause (issue 13.14).

Membership (``membership``): who the shard counts, and what happens to a worker it waited for
too long (``tick``: the worker-loss policy).
"""
from __future__ import annotations

import bisect
import logging
import time

import numpy as np

from commrt.runtime.config import PsConfig
from commrt.runtime.dtypes import NAMES
from commrt.obs.ratelimit import RateLimited
from commrt.runtime.errors import ProtocolError
from commrt.ps import protocol as P
from commrt.ps.durable import NUMPY_DTYPES
from commrt.ps.parked import Parked, Waiting
from commrt.ps.binding import Binding
from commrt.ps.incarnations import Incarnations
from commrt.ps.membership import Membership
from commrt.ps.recovery import Durability, StorageFailed
from commrt.ps.state import MAX_AHEAD, ShardState

log = logging.getLogger(__name__)
_limited = RateLimited(log)  # a worker retrying a refused request in a loop must not flood the log
# upper bounds (seconds) of the apply-latency histogram's buckets, as Prometheus' defaults span
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)

__all__ = ["MAX_AHEAD", "Reply", "ServerCore", "StorageFailed"]


Reply = P.Routed
_reply = P.routed


class ServerCore(Durability, Binding, Membership):
    def __init__(self, cfg: PsConfig, index: int, state: ShardState, connected=None):
        """``connected(ident)``: whether a connection is still open (ps/incarnations.py)."""
        self.cfg, self.index, self.state = cfg, index, state
        self.incarnations = Incarnations(connected)
        self.waiting = Waiting()
        self.pushes = self.waiting.pushes  # (worker, step) -> parked push
        self.failure: str | None = None  # set when a durable write failed: the shard stops
        self.counters = dict(pushes=0, pulls=0, duplicates=0, rejected=0, malformed=0,
                             bytes_in=0, bytes_out=0, ssp_waits=0)
        # one source of truth for server-status and the Prometheus metrics (ps/metrics.py):
        # per bucket (not cumulative) counts, the last one for anything slower than every bound
        self.apply_latency = dict(buckets=list(LATENCY_BUCKETS), counts=[0] * (len(LATENCY_BUCKETS) + 1),
                                  sum=0.0, count=0)
        self._snapshot: dict[int, bytes] = {}
        self._snapshot_version = -1
        self._applying: list[Parked] = []  # the pushes of the update in hand (answered by _fail)
        Durability.__init__(self, cfg, index)
        if not state.initialized:  # fresh (a resumed shard reads its members from the checkpoint)
            state.late.update(range(cfg.initial_workers or state.workers, state.workers))

    # -- entry points -----------------------------------------------------------------------
    def handle(self, ident: bytes, frames: list, now: float, peer: str | None = None) -> list[Reply]:
        """``peer``: the authenticated key name of the sender (CURVE), checked against the
        worker id the request claims; None without authentication."""
        self.counters["bytes_in"] += sum(len(f) for f in frames)
        try:
            req = P.decode_request(frames[0])
        except (ProtocolError, IndexError) as exc:
            self.counters["malformed"] += 1
            _limited.warning(f"server {self.index}: malformed request", "server %d: dropped a malformed request: %s",
                             self.index, exc)
            return []
        if self.failure is not None:
            return [_reply(ident, P.FAILED, req.req_id, [self.failure])]
        out: list[Reply] = []  # filled as it goes: a failed write keeps the answers made before it
        try:
            try:
                if peer is not None and req.op != P.STATS and peer != f"rank{req.worker}":
                    raise ProtocolError(f"request claims worker {req.worker} but comes with {peer}'s key")
                if req.op != P.STATS and req.worker < self.state.workers and self.incarnations.claim(ident, req):
                    out += self._void_predecessor(req.worker)
                out += self._dispatch(ident, req, frames[1:], now)
            except ProtocolError as exc:
                return [self._rejected(ident, req, str(exc))]
            return self._progress(now, out)
        except StorageFailed as exc:
            return out + self._fail(str(exc), out, ident, req)

    def _rejected(self, ident: bytes, req: P.Request, why: str) -> Reply:
        self.counters["rejected"] += 1
        _limited.warning(f"server {self.index}: rejected {P.OP_NAMES[req.op]}", "server %d: rejected %s from worker %d: %s",
                         self.index, P.OP_NAMES[req.op], req.worker, why)
        return _reply(ident, P.ERROR, req.req_id, [why])

    def _refuse(self, p: Parked, why: str) -> Reply:
        self.waiting.remove(p)
        return _reply(p.ident, P.ERROR, p.req.req_id, [f"worker {p.req.worker} {why}"])

    def _void_predecessor(self, worker: int) -> list[Reply]:
        """A new process took ``worker``'s id from one whose connection is gone: what that one
        left parked is void (the new one resumes at the worker's clock and pushes again)."""
        left = [p for p in self.waiting.all() if p.req.worker == worker]
        log.warning("server %d: a new process took worker %d's id (the previous one's connection closed); "
                    "%d request(s) it left parked are void", self.index, worker, len(left))
        return [self._refuse(p, "was replaced by a new process under its id: this request is void") for p in left]

    def _fail(self, why: str, answered: list[Reply], ident: bytes | None = None,
              req: P.Request | None = None) -> list[Reply]:
        """A durable write failed: answer everyone waiting with the cause (the update in hand
        too: its pushes left the parked set when it began), and the request at hand unless
        ``answered`` (the replies made before the failure) holds its answer; the server loop
        stops once these replies are out."""
        self.failure = f"server {self.index} stopped: {why}"
        log.error("%s", self.failure)
        left, self._applying = self._applying + self.waiting.all(), []
        out = [_reply(p.ident, P.FAILED, p.req.req_id, [self.failure]) for p in left]
        for p in left:
            self.waiting.remove(p)
        if req is not None and not any(r.ident == ident and P.decode_reply(r.frames[0]).req_id == req.req_id
                                       for r in answered + out):
            out.append(_reply(ident, P.FAILED, req.req_id, [self.failure]))
        return out

    # -- requests ---------------------------------------------------------------------------
    def _dispatch(self, ident: bytes, req: P.Request, payload: list, now: float) -> list[Reply]:
        if req.op == P.PING:
            status = P.PENDING if self.waiting.waiting(req.worker, req.req_id) else P.UNKNOWN
            return [_reply(ident, status, req.req_id, [])]
        if req.op == P.STATS:
            return [_reply(ident, P.OK, req.req_id, self.stats())]
        w = req.worker
        if w >= self.state.workers:
            raise ProtocolError(f"worker {w} is out of range (this job has {self.state.workers})")
        if req.op == P.INIT:
            return self._init(ident, req, payload, now)
        if not self.state.initialized:
            raise ProtocolError("parameters are not initialised yet (call init first)")
        if w not in self.state.joined:
            raise ProtocolError(f"worker {w} has no accepted init on this server (it failed or never "
                                "happened): call init with the parameters every worker registers")
        if req.op == P.JOIN:
            return self._admit(ident, req)
        if w in self.state.dropped:
            raise ProtocolError(f"worker {w} was dropped after it went silent (its init takes it back "
                                "in async and ssp mode)")
        if w in self.state.late:
            raise ProtocolError(f"worker {w} is a late joiner not admitted yet: init admits it")
        if req.op == P.PULL:
            return self._pull(ident, req, payload, now)
        return self._push(ident, req, payload, now)

    def _check_ids(self, ids: list[int], payload: list, with_data: bool) -> None:
        n = len(self.state.segs)
        if len(set(ids)) != len(ids) or (ids and max(ids) >= n):
            raise ProtocolError(f"segment ids must be distinct and below {n}")
        if not with_data:
            return
        if len(payload) != len(ids):
            raise ProtocolError(f"{len(ids)} segments named but {len(payload)} payload frames sent")
        for i, frame in zip(ids, payload):
            seg = self.state.segs[i]
            if len(frame) != seg.nbytes:
                raise ProtocolError(f"{seg.name}[{seg.start}:{seg.stop}] needs {seg.nbytes} bytes of "
                                    f"{NAMES[seg.dtype]}, got {len(frame)}")
        if self.state.spec.kind == "lamb":
            named = {self.state.segs[i].name for i in ids}
            whole = {i for i, s in enumerate(self.state.segs) if s.name in named}
            if whole != set(ids):
                raise ProtocolError("LAMB needs whole tensors: push every segment of a tensor together")

    def _level(self, clock: int) -> int:
        """The slowest live worker's clock at which a pull at ``clock`` may be served."""
        if self.cfg.mode == "async":
            return -1
        return clock - (self.cfg.staleness if self.cfg.mode == "ssp" else 0)

    def _pull(self, ident: bytes, req: P.Request, payload: list, now: float) -> list[Reply]:
        self._check_ids(req.body, payload, with_data=False)
        clock = self.state.clocks[req.worker]
        # a client pulls at the step its acknowledged pushes reached, which is its clock here; a
        # pull beyond it would wait for the worker's own pushes, for ever, and the worker-loss
        # policy would then drop every healthy worker (issue 13.8)
        if req.step > clock:
            raise ProtocolError(f"pull for step {req.step} is ahead of worker {req.worker}'s step "
                                f"{clock} here: no schedule can ever serve it")
        self._park_pull(Parked(ident, req, now, clock=req.step))
        self.counters["pulls"] += 1
        return []

    def _park_pull(self, p: Parked, bounded: bool = True) -> None:
        level = self._level(p.clock)
        self.waiting.park_pull(p, level, bounded)
        if self.cfg.mode == "ssp" and level > self.state.min_clock():
            self.counters["ssp_waits"] += 1  # held by the staleness bound, not by its own pushes

    def _push(self, ident: bytes, req: P.Request, payload: list, now: float) -> list[Reply]:
        self._check_ids(req.body, payload, with_data=True)
        w, step, clock = req.worker, req.step, self.state.clocks[req.worker]
        if step < clock:
            if step not in self.state.recent[w]:
                raise ProtocolError(f"stale push: worker {w} step {step} is older than the "
                                    f"de-duplication window (worker is at step {clock})")
            self.counters["duplicates"] += 1
            return self._acknowledge(Parked(ident, req, now), P.DUPLICATE, now)
        if step - clock > MAX_AHEAD:
            raise ProtocolError(f"push for step {step} is too far ahead of worker {w}'s step {clock}")
        grads = [np.frombuffer(f, dtype=NUMPY_DTYPES[self.state.segs[i].dtype]) for f, i in zip(payload, req.body)]
        if (w, step) not in self.pushes:
            self.counters["pushes"] += 1
            if self.cfg.mode == "ssp" and step - self.state.min_clock() > self.cfg.staleness:
                self.counters["ssp_waits"] += 1
        self.waiting.park_push(Parked(ident, req, now, grads=grads))
        return []

    def _acknowledge(self, p: Parked, status: int, now: float) -> list[Reply]:
        if p.req.op == P.PUSHPULL:  # the pull half waits for its own condition
            self._park_pull(Parked(p.ident, p.req, now, clock=p.req.step + 1), bounded=False)
            return []
        return [_reply(p.ident, status, p.req.req_id, [self.state.version])]

    # -- progress ---------------------------------------------------------------------------
    def _progress(self, now: float, out: list[Reply]) -> list[Reply]:
        """Apply what became ready and answer what that unblocked, appending to ``out``."""
        while self._apply_ready(out, now):
            pass
        if not self.state.initialized:
            return out
        for p in list(self.waiting.inits):
            reply = self._answer_init(p)  # may fail to log: p stays parked for _fail to answer
            self.waiting.remove(p)
            out.append(reply)
        out += [self._serve_pull(p) for p in self.waiting.ready_pulls(self.state.min_clock())]
        return out

    def _serve_pull(self, p: Parked) -> Reply:
        ids = p.req.body
        if self._snapshot_version != self.state.version:
            self._snapshot, self._snapshot_version = {}, self.state.version
        # a copy (later updates must not race the send), made once per version for all pullers
        for i in ids:
            if i not in self._snapshot:
                self._snapshot[i] = self.state.params[i].tobytes()
        values = [self._snapshot[i] for i in ids]
        self.counters["bytes_out"] += sum(len(v) for v in values)
        return _reply(p.ident, P.OK, p.req.req_id, [self.state.version, ids], values)

    def _apply_ready(self, out: list[Reply], now: float) -> bool:
        """Apply one update if one is ready; returns whether it did."""
        if self.cfg.mode == "sync":
            step = self.state.version
            live = self.state.active()
            if not live or not all((w, step) in self.pushes for w in live):
                return False
            group = self._applying = [self.waiting.take_push((w, step)) for w in live]
            self._update(group, [(w, step) for w in live], gap=0)
        else:
            order = sorted(self.pushes, key=lambda k: (k[1], k[0]))
            ready = next((k for k in order if k[1] == self.state.clocks[k[0]] and (
                self.cfg.mode == "async" or k[1] - self.state.min_clock() <= self.cfg.staleness)), None)
            if ready is None:
                return False
            gap = ready[1] - self.state.min_clock()
            group = self._applying = [self.waiting.take_push(ready)]
            self._update(group, [ready], gap=gap)
        self._applying = []
        for p in group:
            p.grads = []  # applied: the received frames can go
            out += self._acknowledge(p, P.OK, now)
        return True

    def _update(self, group: list[Parked], contributions: list[tuple[int, int]], gap: int) -> None:
        """Average the group's gradients (in worker order: deterministic) and apply them. A
        segment a member did not push counts as a zero gradient (torch DDP's unused parameter):
        the divisor is the group's size, not the count of its pushers."""
        ids = sorted({i for p in group for i in p.req.body})
        grads = []
        by_seg = [dict(zip(p.req.body, p.grads)) for p in group]
        for i in ids:
            parts = [g[i] for g in by_seg if i in g]
            total = np.add(parts[0], parts[1]) if len(parts) > 1 else parts[0].copy()
            for part in parts[2:]:
                total += part
            if len(group) > 1:
                total /= len(group)
            grads.append(total)
        self._log({"k": "u", "v": self.state.version + 1, "ids": ids,
                   "c": [list(c) for c in contributions], "g": gap}, grads)
        start = time.perf_counter()
        self.state.apply(ids, grads)
        self._observe_apply(time.perf_counter() - start)
        self.state.record(contributions, gap)
        self.checkpoint_if_due()

    def _observe_apply(self, seconds: float) -> None:
        h = self.apply_latency
        h["counts"][bisect.bisect_left(h["buckets"], seconds)] += 1
        h["sum"] += seconds
        h["count"] += 1

    def stats(self) -> dict:
        st = self.state
        top = max(st.clocks) if st.clocks else 0
        return {**self.counters, "server": self.index, "mode": self.cfg.mode, "version": st.version,
                "segments": len(st.segs), "param_bytes": sum(s.nbytes for s in st.segs),
                "clocks": list(st.clocks), "lag": [top - c for c in st.clocks],
                "dropped": sorted(st.dropped), "late": sorted(st.late), "joined": sorted(st.joined),
                "staleness": {str(k): v for k, v in sorted(st.staleness.items())},
                "parked": self.waiting.counts(),
                "apply_latency": {**self.apply_latency, "counts": list(self.apply_latency["counts"])}}
