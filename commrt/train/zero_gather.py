"""Stage 3's gathers, as part of ``zero.Zero``: a unit's shards all-gathered before its forward
and backward (from hpZ's node-local secondary copy while it is current; in int8 under qwZ),
viewed by the parameters until ``release``, and the bytes held beyond the shards counted."""
from __future__ import annotations

import time

import torch

from commrt import distributed as dist
from commrt import quant as cq
from commrt.train.followups import Followup
from commrt.train.units import UnitState


class Gathering:
    """Mixed into ``Zero``, which holds the groups, dtype, clock and issue queue these use."""

    def start_gather(self, u: UnitState) -> bool:
        """Issue ``u``'s all-gather unless it is gathered or in flight; False (nothing issued)
        when ``u``'s step is due (``zero_defer``): a prefetch stops there, on every rank alike,
        and the gather at its use takes the step first."""
        self.progress()
        if u.step_due is not None:
            return False
        if u.full is not None or u.gathering is not None:
            return True
        if self.shards == 1 and not self.qwz:  # a gather over one rank is a copy of the master
            buf = u.master.to(self.dtype, copy=True)
            self.count_live(buf.numel() * buf.element_size())
            self._gathered(u, buf, True)
            return True
        buf = torch.empty(u.layout.padded, dtype=self.dtype)
        if u.fresh:  # hpZ: inside the node only
            work = self._issue("hpZ all_gather", self._start_secondary_gather, buf, u.secondary)
            u.gathering = Followup(work, self._gathered, (u, buf, False), time.perf_counter())
        else:
            # the master itself in fp32: it changes only in update, which waits out every gather first
            send = u.master if self.dtype == torch.float32 and not self.qwz else u.master.to(self.dtype, copy=True)
            work = self._issue("all_gather", self._start_primary_gather, buf, send)
            u.gathering = Followup(work, self._gathered, (u, buf, True), time.perf_counter())
        self.count_live(buf.numel() * buf.element_size())
        return True

    def _start_secondary_gather(self, buf: torch.Tensor, secondary: torch.Tensor):
        return dist.all_gather_into_tensor(buf, secondary, self.hgroup, async_op=True)

    def _start_primary_gather(self, buf: torch.Tensor, send: torch.Tensor):
        if self.qwz:  # qwZ: the primary (cross-node) gathers in int8
            return cq.all_gather_into_tensor(buf, send, self.sgroup, async_op=True, quant="int8")
        return dist.all_gather_into_tensor(buf, send, self.sgroup, async_op=True)

    def gather(self, u: UnitState) -> None:
        self.settle(u)  # zero_defer: its replica all-reduce landed and its due step taken
        self.start_gather(u)
        if u.gathering is None:
            return
        u.gathering.finish(self.clock)

    def _gathered(self, u: UnitState, buf: torch.Tensor, primary: bool) -> None:
        """A unit's all-gather arrived: the parameters view it until ``release``."""
        u.gathering, u.full = None, buf
        u.views(buf)
        if primary and u.secondary is not None:  # refresh the secondary copy from what arrived
            lo, hi = u.layout.shard(dist.get_rank(self.hgroup), dist.get_world_size(self.hgroup))
            u.secondary.copy_(buf[lo:hi])
            u.fresh = True

    def count_live(self, nbytes: int) -> None:
        """Gathered (or being gathered) units' bytes: what stage 3 holds beyond its shards."""
        self.live_bytes += nbytes
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)

    def release(self, u: UnitState) -> None:
        if self.resident:
            return
        if u.full is not None:
            self.count_live(-u.full.numel() * u.full.element_size())
        u.full = None
        for p in u.params:
            p.data = torch.empty(0, dtype=self.dtype)
