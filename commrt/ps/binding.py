"""Binding a shard to one description of the parameters (issue 13.11): the seed's init fixes
the segments (name, start, stop, dtype) and every tensor's full shape; every other init is
compared with it (one that arrives before the seed parks until then), and only workers whose
init matched may push or pull, so a push (segment numbers and byte counts) can never land on
another tensor than its sender meant.
"""
from __future__ import annotations

import logging
import math

import numpy as np

from commrt.runtime.errors import ProtocolError
from commrt.ps import protocol as P
from commrt.ps.durable import NUMPY_DTYPES
from commrt.ps.parked import Parked
from commrt.ps.state import FLOAT_CODES, SegInfo

log = logging.getLogger("commrt.ps.core")


class Binding:
    """Mixed into ``ServerCore`` (uses its state, waiting, checkpoint, _log and _rejected)."""

    def _init(self, ident: bytes, req: P.Request, payload: list, now: float) -> list[P.Routed]:
        seed, segs, shapes = req.body
        segs = [SegInfo(*s) for s in segs]
        bad = [s.name for s in segs if s.dtype not in FLOAT_CODES]
        if bad:
            raise ProtocolError(f"parameters must be float32 or float64; not so: {bad[:5]}")
        described = {name: tuple(dims) for name, dims in shapes}
        if len(described) != len(shapes):
            raise ProtocolError("each tensor's shape must be described once")
        p = Parked(ident, req, now, init=(segs, described))
        if self.state.initialized:
            return [self._answer_init(p)]
        if not seed:  # wait for the seed, then be checked against it
            self.waiting.park_init(p)
            return []
        self._seed(segs, described, payload, req.worker)
        return [self._answer_init(p)]  # parked inits are answered by _progress

    def _seed(self, segs: list[SegInfo], shapes: dict, payload: list, worker: int) -> None:
        if len(payload) != len(segs) or any(len(f) != s.nbytes for f, s in zip(payload, segs)):
            raise ProtocolError("init values do not match the segment descriptions")
        short = [s.name for s in segs if s.name not in shapes or s.stop > math.prod(shapes[s.name])]
        if short:
            raise ProtocolError(f"segments lie outside their tensor's described shape: {short[:5]}")
        self.state.seed(segs, [np.frombuffer(f, dtype=NUMPY_DTYPES[s.dtype]) for f, s in zip(payload, segs)],
                        shapes)
        self.checkpoint()
        log.info("server %d: seeded %d segments by worker %d", self.index, len(segs), worker)

    def _answer_init(self, p: Parked) -> P.Routed:
        w, why = p.req.worker, self._differs(*p.init)
        # a refused init changes nothing: worker w's accepted one (if any) stays (issue 30.7)
        if why is not None:
            return self._rejected(p.ident, p.req, f"worker {w} describes different parameters than the "
                                  f"ones this server holds: {why}")
        unwelcome = self._unwelcome(w)
        if unwelcome is not None:
            return self._rejected(p.ident, p.req, unwelcome)
        self._join(w)  # bound to the description; membership changes only by JOIN (ps/membership.py)
        return P.routed(p.ident, P.OK, p.req.req_id,
                        [self.state.version, self.state.clocks[w], *self._membership(w)])

    def _differs(self, segs: list[SegInfo], shapes: dict) -> str | None:
        """What differs from the seed's description (None: nothing)."""
        mine = self.state.segs
        if segs != mine:
            diff = next((f"{a} here, {b} described" for a, b in zip(mine, segs) if a != b),
                        f"{len(mine)} segments here, {len(segs)} described")
            return f"segments differ ({diff})"
        if self.state.shapes is None:  # a checkpoint from before shapes were recorded
            self.state.shapes = shapes
        for name in sorted(set(shapes) | set(self.state.shapes)):
            if shapes.get(name) != self.state.shapes.get(name):
                return f"{name} has shape {self.state.shapes.get(name)} here, {shapes.get(name)} described"
        return None

    def _join(self, worker: int) -> None:
        if worker not in self.state.joined:
            self.state.joined.add(worker)
            self._log({"k": "j", "w": worker, "on": True}, [])
