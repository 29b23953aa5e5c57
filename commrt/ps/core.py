"""A server shard's request logic, without sockets: frames in, replies out.

``handle(ident, frames, now)`` and ``tick(now)`` return the replies to send. Requests that must
wait (a sync step not yet complete, an SSP worker too far ahead, a pull for a version not yet
reached) are parked and answered by a later call. Every request is validated completely before
anything changes, so a bad one gets an error reply and leaves the state as it was.

Exactly-once: a push is identified by (worker, step). Each worker's steps are applied in order;
a re-sent push that was already applied is acknowledged as a duplicate, never applied twice;
a push is acknowledged only after it was applied (and logged, when durable).
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import NamedTuple

import numpy as np
import torch

from ..config import PsConfig
from ..dtypes import NAMES
from ..errors import ProtocolError
from . import protocol as P
from .durable import NUMPY_DTYPES, WriteAheadLog, read_log
from .state import FLOAT_CODES, SegInfo, ShardState

log = logging.getLogger(__name__)
MAX_AHEAD = 8  # pushes a worker may have in flight beyond its next step


class Reply(NamedTuple):
    ident: bytes
    frames: list


@dataclasses.dataclass
class Parked:
    ident: bytes
    req: P.Request
    since: float
    grads: list | None = None  # pushes: one array per segment
    clock: int = 0  # pulls: the worker's clock


def _reply(ident: bytes, status: int, req_id: int, body, payload: list | None = None) -> Reply:
    return Reply(ident, [P.encode_reply(status, req_id, body), *(payload or [])])


class ServerCore:
    def __init__(self, cfg: PsConfig, index: int, state: ShardState):
        self.cfg, self.index, self.state = cfg, index, state
        self.pushes: dict[tuple[int, int], Parked] = {}
        self.pulls: list[Parked] = []
        self.inits: list[Parked] = []
        self.counters = dict(pushes=0, pulls=0, duplicates=0, rejected=0, malformed=0,
                             bytes_in=0, bytes_out=0)
        self.wal: WriteAheadLog | None = None
        self._snapshot: dict[int, bytes] = {}
        self._snapshot_version = -1
        self.ckpt_path = ""
        if cfg.checkpoint_dir:
            os.makedirs(cfg.checkpoint_dir, exist_ok=True)
            self.ckpt_path = os.path.join(cfg.checkpoint_dir, f"server-{index}.ckpt")
            self.wal_path = os.path.join(cfg.checkpoint_dir, f"server-{index}.wal")

    # -- durability -------------------------------------------------------------------------
    def has_checkpoint(self) -> bool:
        return bool(self.ckpt_path) and os.path.exists(self.ckpt_path)

    def resume(self) -> int:
        """Load the checkpoint and replay the log after it; returns how many updates replayed."""
        self.state.load(self.ckpt_path)
        replayed = 0
        for meta, arrays in read_log(self.wal_path):
            if meta.get("k") == "d":
                self.state.dropped.update(meta["w"])
            elif meta.get("k") == "u" and meta["v"] > self.state.version:
                self.state.apply(meta["ids"], [torch.from_numpy(a) for a in arrays])
                self.state.record([tuple(c) for c in meta["c"]], meta.get("g"))
                replayed += 1
        self.checkpoint()
        return replayed

    def checkpoint(self) -> None:
        if not self.ckpt_path or not self.state.initialized:
            return
        self.state.save(self.ckpt_path)
        if self.wal is None:
            self.wal = WriteAheadLog(self.wal_path, self.cfg.fsync)
        self.wal.truncate()

    def _log(self, meta: dict, arrays: list[torch.Tensor]) -> None:
        if self.wal is not None:
            self.wal.append(meta, [a.numpy() for a in arrays], [self.state.segs[i].dtype for i in meta.get("ids", [])])

    # -- entry points -----------------------------------------------------------------------
    def handle(self, ident: bytes, frames: list, now: float, peer: str | None = None) -> list[Reply]:
        """``peer``: the authenticated key name of the sender (CURVE), checked against the
        worker id the request claims; None without authentication."""
        self.counters["bytes_in"] += sum(len(f) for f in frames)
        try:
            req = P.decode_request(frames[0])
        except (ProtocolError, IndexError) as exc:
            self.counters["malformed"] += 1
            log.warning("server %d: dropped a malformed request: %s", self.index, exc)
            return []
        try:
            if peer is not None and req.op != P.STATS and peer != f"rank{req.worker}":
                raise ProtocolError(f"request claims worker {req.worker} but comes with {peer}'s key")
            out = self._dispatch(ident, req, frames[1:], now)
        except ProtocolError as exc:
            self.counters["rejected"] += 1
            log.warning("server %d: rejected %s from worker %d: %s", self.index,
                        P.OP_NAMES[req.op], req.worker, exc)
            return [_reply(ident, P.ERROR, req.req_id, [str(exc)])]
        return out + self._progress(now)

    def tick(self, now: float) -> list[Reply]:
        """Apply the worker-loss policy to anything parked for longer than worker_timeout_s."""
        limit = now - self.cfg.worker_timeout_s
        stuck = [p for p in self._parked() if p.since < limit]
        if not stuck:
            return []
        missing = self._laggards(stuck)
        if self.cfg.on_worker_loss == "continue" and missing and self.state.initialized:
            log.warning("server %d: dropping worker(s) %s (silent for %gs); continuing without them",
                        self.index, missing, self.cfg.worker_timeout_s)
            self.state.dropped.update(missing)
            if self.wal is not None:
                self.wal.append({"k": "d", "w": missing}, [], [])
            out = [self._refuse(p, "was dropped after it went silent") for p in self._parked()
                   if p.req.worker in self.state.dropped]
            return out + self._progress(now)
        out = []
        for p in stuck:
            msg = (f"server {self.index}: {P.OP_NAMES[p.req.op]} step {p.req.step} of worker "
                   f"{p.req.worker} waited {self.cfg.worker_timeout_s:g}s for worker(s) {missing}")
            out.append(_reply(p.ident, P.LOST, p.req.req_id, [msg, missing]))
            self._unpark(p)
        return out

    def _parked(self) -> list[Parked]:
        return [*self.pushes.values(), *self.pulls, *self.inits]

    def _refuse(self, p: Parked, why: str) -> Reply:
        self._unpark(p)
        return _reply(p.ident, P.ERROR, p.req.req_id, [f"worker {p.req.worker} {why}"])

    # -- requests ---------------------------------------------------------------------------
    def _dispatch(self, ident: bytes, req: P.Request, payload: list, now: float) -> list[Reply]:
        if req.op == P.PING:
            waiting = any(p.req.req_id == req.req_id and p.req.worker == req.worker
                          for p in self._parked())
            return [_reply(ident, P.PENDING if waiting else P.UNKNOWN, req.req_id, [])]
        if req.op == P.STATS:
            return [_reply(ident, P.OK, req.req_id, self.stats())]
        if req.worker >= self.state.workers:
            raise ProtocolError(f"worker {req.worker} is out of range (this job has {self.state.workers})")
        if req.op == P.INIT:
            return self._init(ident, req, payload, now)
        if not self.state.initialized:
            raise ProtocolError("parameters are not initialised yet (call init first)")
        if req.worker in self.state.dropped:
            raise ProtocolError(f"worker {req.worker} was dropped after it went silent")
        if req.op == P.PULL:
            self._check_ids(req.body, payload, with_data=False)
            self.counters["pulls"] += 1
            self.pulls.append(Parked(ident, req, now, clock=req.step))
            return []
        return self._push(ident, req, payload, now)

    def _init(self, ident: bytes, req: P.Request, payload: list, now: float) -> list[Reply]:
        seed, segs = req.body
        segs = [SegInfo(*s) for s in segs]
        bad = [s.name for s in segs if s.dtype not in FLOAT_CODES]
        if bad:
            raise ProtocolError(f"parameters must be float32 or float64; not so: {bad[:5]}")
        if self.state.initialized:
            if segs != self.state.segs:
                raise ProtocolError(f"worker {req.worker} describes different parameters than the "
                                    "ones this server holds (names, shapes or dtypes differ)")
        elif seed:
            if len(payload) != len(segs) or any(len(f) != s.nbytes for f, s in zip(payload, segs)):
                raise ProtocolError("init values do not match the segment descriptions")
            self.state.seed(segs, [np.frombuffer(f, dtype=NUMPY_DTYPES[s.dtype]) for f, s in zip(payload, segs)])
            self.checkpoint()
            log.info("server %d: seeded %d segments by worker %d", self.index, len(segs), req.worker)
        self.inits.append(Parked(ident, req, now))
        return []

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

    def _push(self, ident: bytes, req: P.Request, payload: list, now: float) -> list[Reply]:
        self._check_ids(req.body, payload, with_data=True)
        w, step, clock = req.worker, req.step, self.state.clocks[req.worker]
        if step < clock:
            if step not in self.state.recent[w]:
                raise ProtocolError(f"stale push: worker {w} step {step} is older than the "
                                    f"de-duplication window (worker is at step {clock})")
            self.counters["duplicates"] += 1
            return self._acknowledge(Parked(ident, req, now), P.DUPLICATE)
        if step - clock > MAX_AHEAD:
            raise ProtocolError(f"push for step {step} is too far ahead of worker {w}'s step {clock}")
        grads = [np.frombuffer(f, dtype=NUMPY_DTYPES[self.state.segs[i].dtype]) for f, i in zip(payload, req.body)]
        if (w, step) not in self.pushes:
            self.counters["pushes"] += 1
        self.pushes[(w, step)] = Parked(ident, req, now, grads=grads)  # a re-send replaces the routing
        return []

    def _acknowledge(self, p: Parked, status: int) -> list[Reply]:
        if p.req.op == P.PUSHPULL:  # the pull half waits for its own condition
            self.pulls.append(Parked(p.ident, p.req, p.since, clock=p.req.step + 1))
            return []
        return [_reply(p.ident, status, p.req.req_id, [self.state.version])]

    def _unpark(self, p: Parked) -> None:
        if p.grads is not None:
            self.pushes.pop((p.req.worker, p.req.step), None)
        elif p in self.pulls:
            self.pulls.remove(p)
        elif p in self.inits:
            self.inits.remove(p)

    # -- progress ---------------------------------------------------------------------------
    def _progress(self, now: float) -> list[Reply]:
        out: list[Reply] = []
        while self._apply_ready(out):
            pass
        if self.state.initialized:
            for p in self.inits:
                out.append(_reply(p.ident, P.OK, p.req.req_id,
                                  [self.state.version, self.state.clocks[p.req.worker]]))
            self.inits.clear()
        ready = [p for p in self.pulls if self._pull_ready(p.clock)]
        for p in ready:
            self.pulls.remove(p)
            out.append(self._serve_pull(p))
        return out

    def _pull_ready(self, clock: int) -> bool:
        if self.cfg.mode == "async":
            return True
        bound = self.cfg.staleness if self.cfg.mode == "ssp" else 0
        return self.state.min_clock() >= clock - bound

    def _serve_pull(self, p: Parked) -> Reply:
        ids = p.req.body
        if self._snapshot_version != self.state.version:
            self._snapshot, self._snapshot_version = {}, self.state.version
        # a copy (later updates must not race the send), made once per version for all pullers
        for i in ids:
            if i not in self._snapshot:
                self._snapshot[i] = self.state.params[i].numpy().tobytes()
        values = [self._snapshot[i] for i in ids]
        self.counters["bytes_out"] += sum(len(v) for v in values)
        return _reply(p.ident, P.OK, p.req.req_id, [self.state.version, ids], values)

    def _apply_ready(self, out: list[Reply]) -> bool:
        """Apply one update if one is ready; returns whether it did."""
        if self.cfg.mode == "sync":
            step = self.state.version
            live = self.state.active()
            if not live or not all((w, step) in self.pushes for w in live):
                return False
            group = [self.pushes.pop((w, step)) for w in live]
            self._update(group, [(w, step) for w in live], gap=0)
        else:
            order = sorted(self.pushes, key=lambda k: (k[1], k[0]))
            ready = next((k for k in order if k[1] == self.state.clocks[k[0]] and (
                self.cfg.mode == "async" or k[1] - self.state.min_clock() <= self.cfg.staleness)), None)
            if ready is None:
                return False
            gap = ready[1] - self.state.min_clock()
            group = [self.pushes.pop(ready)]
            self._update(group, [ready], gap=gap)
        for p in group:
            out += self._acknowledge(p, P.OK)
        return True

    def _update(self, group: list[Parked], contributions: list[tuple[int, int]], gap: int) -> None:
        """Average the group's gradients (in worker order: deterministic) and apply them."""
        ids = sorted({i for p in group for i in p.req.body})
        grads = []
        by_seg = [dict(zip(p.req.body, p.grads)) for p in group]
        for i in ids:
            parts = [g[i] for g in by_seg if i in g]
            total = np.add(parts[0], parts[1]) if len(parts) > 1 else parts[0].copy()
            for part in parts[2:]:
                total += part
            if len(parts) > 1:
                total /= len(parts)
            grads.append(torch.from_numpy(total))
        self._log({"k": "u", "v": self.state.version + 1, "ids": ids,
                   "c": [list(c) for c in contributions], "g": gap}, grads)
        self.state.apply(ids, grads)
        self.state.record(contributions, gap)
        if self.ckpt_path and self.state.version % self.cfg.checkpoint_every == 0:
            self.checkpoint()

    def _laggards(self, stuck: list[Parked]) -> list[int]:
        """The workers the stuck requests are waiting for."""
        if any(p.req.op == P.INIT for p in stuck):
            return [0]  # the seeding worker
        if self.cfg.mode == "sync" and any(p.grads is not None for p in stuck):
            return [w for w in self.state.active() if (w, self.state.version) not in self.pushes]
        bound = self.cfg.staleness if self.cfg.mode == "ssp" else 0
        need = max((p.req.step if p.grads is not None else p.clock) - bound for p in stuck)
        return [w for w in self.state.active() if self.state.clocks[w] < need]

    def stats(self) -> dict:
        st = self.state
        top = max(st.clocks) if st.clocks else 0
        return {**self.counters, "server": self.index, "mode": self.cfg.mode, "version": st.version,
                "segments": len(st.segs), "param_bytes": sum(s.nbytes for s in st.segs),
                "clocks": list(st.clocks), "lag": [top - c for c in st.clocks],
                "dropped": sorted(st.dropped),
                "staleness": {str(k): v for k, v in sorted(st.staleness.items())},
                "parked": {"pushes": len(self.pushes), "pulls": len(self.pulls), "inits": len(self.inits)}}
