"""Who a shard counts: the worker-loss policy (issue 13.8).

``tick`` applies ``on_worker_loss`` to anything parked longer than ``worker_timeout_s``: the
workers the stuck requests wait for are named (``_laggards``), then either dropped (``continue``:
the shard goes on without them, logged so a resumed shard drops them too) or named in a LOST
reply to everyone waiting (``error``).
"""
from __future__ import annotations

import logging

from commrt.ps import protocol as P
from commrt.ps.parked import Parked, Waiting
from commrt.ps.recovery import StorageFailed
from commrt.ps.state import ShardState
from commrt.runtime.config import PsConfig

log = logging.getLogger("commrt.ps.core")


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
        try:
            return self._on_stuck(stuck, now)
        except StorageFailed as exc:
            return self._fail(str(exc))

    def _on_stuck(self, stuck: list[Parked], now: float) -> list[P.Routed]:
        missing = self._laggards(stuck)
        if self.cfg.on_worker_loss == "continue" and missing and self.state.initialized:
            log.warning("server %d: dropping worker(s) %s (silent for %gs); continuing without them",
                        self.index, missing, self.cfg.worker_timeout_s)
            self.state.dropped.update(missing)
            self._log({"k": "d", "w": missing}, [])
            out = [self._refuse(p, "was dropped after it went silent") for p in self.waiting.all()
                   if p.req.worker in self.state.dropped]
            return out + self._progress(now)
        if self.cfg.mode == "sync" and any(p.grads is not None for p in stuck):
            # the step cannot complete now: answer all of its pushes at once, naming the same workers
            # (a push answered a tick before another would be named as missing by the later one)
            stuck += [p for (_, step), p in self.pushes.items() if step == self.state.version and p not in stuck]
        out = []
        for p in stuck:
            msg = (f"server {self.index}: {P.OP_NAMES[p.req.op]} step {p.req.step} of worker "
                   f"{p.req.worker} waited {self.cfg.worker_timeout_s:g}s for worker(s) {missing}")
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
        need = max((p.req.step if p.grads is not None else p.clock) - bound for p in stuck)
        return [w for w in self.state.active() if self.state.clocks[w] < need]

