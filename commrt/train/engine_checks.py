"""The engine's gradient check before each optimizer step (part of ``engine.Engine``): one
all-reduce tells every rank which ranks saw non-finite gradients, the global gradient norm
(for clipping) and every rank's learning rate; a pipeline of engines sums the norm and the
check over its stages too (``reduce_norm_over``)."""
from __future__ import annotations

import math

import torch

from commrt import distributed as dist
from commrt.collectives.reduce_ops import ReduceOp
from commrt.train.zero_step import squared_norm


class GradientCheck:
    """Mixed into ``Engine``: reads ``zero``, ``group``, ``clock`` and ``_norm_group``."""

    def _check_gradients(self) -> tuple[list[int], float, list[float]]:
        """One all-reduce: which ranks saw non-finite gradients, the global squared norm (NaN
        under zero_defer, whose reductions are still in flight: only clipping would need it), and
        every rank's learning rate for this step (a float64 sum with zeros: each exact)."""
        z = self.zero
        vec = torch.zeros(2 * z.world + 1, dtype=torch.float64)
        vec[z.rank] = float(z.nonfinite)
        vec[z.world + 1 + z.rank] = z.spec.lr
        if z.defer:
            vec[z.world] = math.nan
        elif z.counts_norm:
            vec[z.world] = sum(squared_norm(z.shard_grad(u)) for u in z.units)
        with self.clock.span("comm_waited"):
            dist.all_reduce(vec, ReduceOp.SUM, self.group)
        z.nonfinite = False
        bad = [r for r in range(z.world) if vec[r] > 0]
        total = float(vec[z.world])
        lrs = vec[z.world + 1:].tolist()
        if self._norm_group is not None:
            bad, total = self._across_parts(bad, total)
        return bad, math.sqrt(total) if math.isfinite(total) else (math.nan if z.defer else math.inf), lrs

    def reduce_norm_over(self, group) -> None:
        """Sum the step's gradient norm and non-finite check over ``group`` too: a pipeline's
        group, whose ranks each hold another part of the model. One stage clipping by its own
        part's norm, or skipping a step only where its part saw a NaN, trains another model than
        one process does. Every rank of ``group`` must then step an engine at the same steps."""
        self._norm_group = group

    def _across_parts(self, bad: list, total: float) -> tuple[list, float]:
        g = self._norm_group
        vec = torch.zeros(len(g.ranks) + 1, dtype=torch.float64)
        me = dist.get_rank(g)
        vec[me], vec[-1] = float(len(bad)), total
        with self.clock.span("comm_waited"):
            dist.all_reduce(vec, ReduceOp.SUM, g)
        others = [f"{r} (with another part of the model)" for i, r in enumerate(g.ranks) if i != me and vec[i] > 0]
        return bad + others, float(vec[-1])
