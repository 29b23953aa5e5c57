"""ZeRO stages 0-3 over commrt collectives (Rajbhandari et al., "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models", 2020).

Every trainable parameter belongs to a unit (``layout.Unit``): one flat buffer, sharded evenly.

    stage 0  every rank keeps everything; gradients all-reduced; every rank steps everything
    stage 1  + optimizer state and the fp32 master values only for the own shard; gradients
             all-reduced, each rank steps its shard, then the units are all-gathered
    stage 2  + gradients: each bucket is reduce-scattered from the gradient hooks (during
             backward) into the owner's shard; no rank keeps a full gradient after its bucket
    stage 3  + parameters: a module's unit is all-gathered just before its forward and again
             before its backward, freed after each, the next one prefetched

Sharded over a smaller group (``groups.ShardGroups``, see ``sharding``): hybrid sharding keeps
units sharded inside each shard group and averages each shard's gradient over its replicas;
hpZ keeps the stage-3 shards over every rank plus a secondary copy inside each node, which a
unit's gathers read from as long as it is current (from the first gather after a step, which
reads the primary shards, until the next step).

ZeRO++ (Wang et al., "ZeRO++: Extremely Efficient Collective Communication for Giant Model
Training", 2023): qwZ gathers stage-3 parameters in int8, qgZ reduces gradients in int4 (an
all-to-all of quantized chunks, then an fp32 reduction), optionally with LoCo error feedback
per unit. Master weights and optimizer state stay fp32 and exact.

ZeRO++ with ``overlap_comm`` issues every one of the engine's collectives from one comm stream
(``stream.CommStream``), so that the quantized compositions overlap compute; ``wait`` ends with a
fence, after which the engine's own calls (norms, LAMB, checkpoints) use the groups directly.
"""
from __future__ import annotations

import weakref

import torch
from torch import nn

from commrt import distributed as dist
from commrt.optim import rules as optim
from commrt import quant as cq
from commrt.collectives.reduce_ops import ReduceOp
from commrt.runtime.errors import ConfigError
from commrt.train.groups import ShardGroups
from commrt.train.layout import Unit, buckets, make_unit, pieces
from commrt.train.stream import CommStream


def run_ready(works: list) -> int:
    """Pop the (work, then) pairs at the front of ``works`` whose work is done and run their
    ``then`` (which may append more); stops at the first one still in flight. Returns how many."""
    ran = 0
    while works and works[0][0].is_completed():
        work, then = works.pop(0)
        work.wait()  # raises the collective's error, if it failed
        then()
        ran += 1
    return ran


class UnitState:
    """One unit's tensors on this rank."""

    def __init__(self, layout: Unit, params: list[nn.Parameter], own: tuple[int, int]):
        self.layout, self.params, self.own = layout, params, own
        self.shapes = [p.shape for p in params]  # kept: stage 3 empties the parameters between uses
        self.full: torch.Tensor | None = None     # gathered values in the compute dtype
        self.master: torch.Tensor | None = None   # fp32 values of the own range (what the optimizer steps)
        self.grad: torch.Tensor | None = None     # fp32: full (stages 0-1) or own shard (2-3)
        self.state: dict[str, torch.Tensor] = {}
        self.pending = 0
        self.gathering = None  # (work, buffer, from the primary shards) of an all-gather in flight
        self.secondary: torch.Tensor | None = None  # hpZ: this rank's part of the in-node copy
        self.fresh = False  # hpZ: the secondary copy holds the values of the last step
        self.feedback = None   # quant.ErrorFeedback of the quantized gradient reduction (LoCo)

    def views(self, flat: torch.Tensor) -> None:
        for p, shape, off, n in zip(self.params, self.shapes, self.layout.offsets, self.layout.numels):
            p.data = flat[off:off + n].view(shape)


def make_units(model: nn.Module, params: list[nn.Parameter], stage: int, cap: int,
               world: int) -> list[list[int]]:
    """Parameter indices per unit: buckets (stages 0-2) or one unit per owning module (stage 3)."""
    if stage < 3:
        return [list(u.params) for u in buckets([p.numel() for p in params], cap, world)]
    index = {id(p): i for i, p in enumerate(params)}
    units, seen = [], set()
    for mod in model.modules():
        mine = [index[id(p)] for p in mod.parameters(recurse=False) if id(p) in index]
        if set(mine) & seen:
            raise ConfigError(f"stage 3 cannot shard a parameter shared between modules "
                              f"({type(mod).__name__}); untie it or use stage 2")
        seen.update(mine)
        if mine:
            units.append(mine)
    return units


class Zero:
    """The per-rank state and communication of one ZeRO-sharded model (used by ``Engine``)."""

    def __init__(self, model: nn.Module, params: list[nn.Parameter], stage: int, spec: optim.OptimSpec,
                 dtype: torch.dtype, cap: int, group=None, overlap: bool = True,
                 groups: ShardGroups = ShardGroups(), qwz: bool = False, qgz: bool = False,
                 loco: dict | None = None):
        self.stage, self.spec, self.dtype, self.group = stage, spec, dtype, group
        self.overlap = overlap
        self.qwz, self.qgz, self.loco = qwz, qgz, loco
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.sgroup = groups.shard if groups.shard is not None else group
        self.rgroup, self.hgroup = groups.replica, groups.secondary
        self.shard_rank, self.shards = dist.get_rank(self.sgroup), dist.get_world_size(self.sgroup)
        # with replicas, one copy of each shard counts towards the global gradient norm
        self.counts_norm = self.rgroup is None or dist.get_rank(self.rgroup) == 0
        self.works: list = []
        # ZeRO++: quantized compositions run on this thread, beside compute (see the module doc)
        self.stream = CommStream() if overlap and (qwz or qgz) else None
        if self.stream is not None:  # its thread ends with the engine
            weakref.finalize(self, self.stream.close)
        self.started_early = 0  # queued works finished (and follow-ups started) from the hooks, before wait()
        self.nonfinite = False
        self.live_bytes = self.peak_live_bytes = 0
        self.units: list[UnitState] = []
        for idx in make_units(model, params, stage, cap, self.world):
            lay = make_unit(idx, [params[i].numel() for i in idx], self.world)
            own = (0, lay.padded) if stage == 0 else lay.shard(self.shard_rank, self.shards)
            self.units.append(self._build(lay, [params[i] for i in idx], own))

    # -- construction -----------------------------------------------------------------------
    def _build(self, lay: Unit, params: list[nn.Parameter], own: tuple[int, int]) -> UnitState:
        u = UnitState(lay, params, own)
        flat = torch.zeros(lay.padded, dtype=torch.float32)
        for p, off, n in zip(params, lay.offsets, lay.numels):
            flat[off:off + n].copy_(p.detach().reshape(-1))
        lo, hi = own
        if self.stage < 3:
            u.full = flat if self.dtype == torch.float32 else flat.to(self.dtype)
            u.master = u.full[lo:hi] if self.dtype == torch.float32 else flat[lo:hi].clone()
            u.views(u.full)
        else:
            u.master = flat[lo:hi].clone()
            if self.hgroup is not None:
                u.secondary = torch.zeros(lay.padded // dist.get_world_size(self.hgroup), dtype=self.dtype)
            self.release(u)
        u.grad = torch.zeros(lay.padded if self.stage < 2 else hi - lo)
        u.state = optim.init_state(self.spec, u.master)
        u.feedback = cq.ErrorFeedback.from_loco(self.loco) if self.loco is not None else None
        return u

    # -- gradients --------------------------------------------------------------------------
    def reduce(self, u: UnitState) -> None:
        """Hand the unit's local gradients to the collective (from a hook, or a final flush)."""
        flat = torch.zeros(u.layout.padded, dtype=self.dtype)
        for p, off, n in zip(u.params, u.layout.offsets, u.layout.numels):
            if p.grad is not None:
                flat[off:off + n].copy_(p.grad.reshape(-1))
                p.grad = None
        if not bool(torch.isfinite(flat).all()):
            self.nonfinite = True  # noted before the reduction mixes it into every rank
            if self.qgz:  # the step will be skipped; the codec would refuse the values
                flat.zero_()
        if self.stage < 2:
            work = self._all_reduce(flat, u)
            self._track(work, lambda: u.grad.copy_(flat))
        else:
            out = torch.empty(u.own[1] - u.own[0], dtype=self.dtype)
            work = self._reduce_scatter(out, flat, u)
            if self.rgroup is None:
                self._track(work, lambda: u.grad.add_(out))
            else:  # hybrid: the group's average of the shard, then the average over the groups
                self._track(work, lambda: self._track(
                    self._issue("replica all_reduce", lambda: dist.all_reduce(out, ReduceOp.AVG, self.rgroup, async_op=True)),
                    lambda: u.grad.add_(out)))
            if self.stage == 3:
                self.release(u)
        self.progress()

    def _all_reduce(self, flat: torch.Tensor, u: UnitState):
        if self.qgz:
            return self._issue("qgZ all_reduce", lambda: cq.all_reduce(flat, ReduceOp.AVG, self.group, True,
                                                                        quant="int4", feedback=u.feedback))
        return self._issue("all_reduce", lambda: dist.all_reduce(flat, ReduceOp.AVG, self.group, async_op=True))

    def _reduce_scatter(self, out: torch.Tensor, flat: torch.Tensor, u: UnitState):
        if self.qgz:
            return self._issue("qgZ reduce_scatter", lambda: cq.reduce_scatter_tensor(
                out, flat, ReduceOp.AVG, self.sgroup, True, quant="int4", feedback=u.feedback))
        return self._issue("reduce_scatter", lambda: dist.reduce_scatter_tensor(out, flat, ReduceOp.AVG, self.sgroup,
                                                                                async_op=True))

    def _issue(self, name: str, start):
        """Start a collective (``start()`` returns its Work): here, or on the comm stream."""
        return start() if self.stream is None else self.stream.submit(name, start)

    def _fence(self) -> None:
        """Return once the stream has issued everything submitted so far (then this thread may
        call collectives on the same groups without changing their order)."""
        if self.stream is not None:
            self.stream.fence()

    def _track(self, work, then) -> None:
        self.works.append((work, then))
        if not self.overlap:
            self.wait()

    def progress(self) -> None:
        """Finish the works at the front of the queue that are done, without blocking: hybrid's
        cross-replica all-reduce of a unit then starts during backward, as soon as its in-group
        reduce-scatter is done, not after backward (called from the gradient and gather hooks).
        Front first only, so every rank starts the follow-up collectives in the same order."""
        self.started_early += run_ready(self.works)

    def wait(self) -> None:
        while self.works:  # a ``then`` may start a further collective (hybrid's second step)
            work, then = self.works.pop(0)
            work.wait()
            then()
        self._fence()

    def own_grad(self, u: UnitState) -> torch.Tensor:
        return u.grad[u.own[0]:u.own[1]] if self.stage < 2 else u.grad

    def shard_grad(self, u: UnitState) -> torch.Tensor:
        """This rank's 1/world of the gradient (for norms: every element counted once)."""
        if self.stage >= 2:
            return u.grad
        lo, hi = u.layout.shard(self.shard_rank, self.shards)
        return u.grad[lo:hi]

    # -- stage 3 gathering ------------------------------------------------------------------
    def start_gather(self, u: UnitState) -> None:
        self.progress()
        if u.full is not None or u.gathering is not None:
            return
        buf = torch.empty(u.layout.padded, dtype=self.dtype)
        if u.fresh:  # hpZ: inside the node only
            sec = u.secondary
            u.gathering = (self._issue("hpZ all_gather", lambda: dist.all_gather_into_tensor(
                buf, sec, self.hgroup, async_op=True)), buf, False)
        else:
            send = u.master.to(self.dtype, copy=True)
            gather = cq.all_gather_into_tensor if self.qwz else dist.all_gather_into_tensor
            kw = {"quant": "int8"} if self.qwz else {}  # qwZ: the primary (cross-node) gathers in int8
            u.gathering = (self._issue("all_gather", lambda: gather(buf, send, self.sgroup, async_op=True, **kw)),
                           buf, True)
        self._count_live(buf.numel() * buf.element_size())

    def gather(self, u: UnitState) -> None:
        self.start_gather(u)
        if u.gathering is None:
            return
        work, buf, primary = u.gathering
        work.wait()
        u.gathering, u.full = None, buf
        u.views(buf)
        if primary and u.secondary is not None:  # refresh the secondary copy from what arrived
            lo, hi = u.layout.shard(dist.get_rank(self.hgroup), dist.get_world_size(self.hgroup))
            u.secondary.copy_(buf[lo:hi])
            u.fresh = True

    def _count_live(self, nbytes: int) -> None:
        """Gathered (or being gathered) units' bytes: what stage 3 holds beyond its shards."""
        self.live_bytes += nbytes
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)

    def release(self, u: UnitState) -> None:
        if u.full is not None:
            self._count_live(-u.full.numel() * u.full.element_size())
        u.full = None
        for p in u.params:
            p.data = torch.empty(0, dtype=self.dtype)

    # -- the optimizer step -----------------------------------------------------------------
    def update(self, step: int, clip_coef: float) -> None:
        for u in self.units:  # a prefetch that was never used would hand out pre-step values
            if u.gathering is not None:
                u.gathering[0].wait()
                self._count_live(-u.gathering[1].numel() * u.gathering[1].element_size())
                u.gathering = None
        lamb = []
        for u in self.units:
            g = self.own_grad(u)
            if clip_coef < 1.0:
                g.mul_(clip_coef)
            if self.spec.kind == "lamb":
                lamb.append((u, optim.lamb_direction_(u.master, g, u.state, self.spec, step)))
            else:
                optim.step_(u.master, g, u.state, self.spec, step)
        if lamb:
            self._lamb_apply(lamb)
        self._publish()
        for u in self.units:
            u.grad.zero_()

    def _lamb_apply(self, lamb: list) -> None:
        """Trust ratio per original parameter from the partial norms of every rank's shard."""
        norms = []
        for u, r in lamb:
            sq = torch.zeros(len(u.params), 2, dtype=torch.float64)
            for k, a, b, _ in pieces(u.layout, *u.own):
                sq[k, 0] = u.master[a:b].double().square().sum()
                sq[k, 1] = r[a:b].double().square().sum()
            norms.append(sq)
        flat = torch.cat(norms) if norms else torch.zeros(0, 2, dtype=torch.float64)
        if self.stage > 0:
            dist.all_reduce(flat, ReduceOp.SUM, self.sgroup)
        row = 0
        for (u, r), sq in zip(lamb, norms):
            part = flat[row:row + len(sq)].sqrt()
            row += len(sq)
            for k, a, b, _ in pieces(u.layout, *u.own):
                trust = optim.trust_ratio(float(part[k, 0]), float(part[k, 1]))
                optim.lamb_apply_(u.master[a:b], r[a:b], trust, self.spec)

    def _publish(self) -> None:
        """Make the new values visible to the model (stages 0-2; stage 3 gathers on use)."""
        if self.stage == 0:
            if self.dtype != torch.float32:
                for u in self.units:
                    u.full.copy_(u.master)
            return
        if self.stage == 3:
            for u in self.units:
                u.fresh = False  # the next gather reads the new primary shards
            return
        for u in self.units:
            send = u.master.to(self.dtype, copy=True)
            self.works.append((dist.all_gather_into_tensor(u.full, send, self.sgroup, async_op=True),
                               lambda: None))
        self.wait()

    # -- consolidated values ----------------------------------------------------------------
    def full_master(self, u: UnitState) -> torch.Tensor:
        """The whole unit's fp32 values (a collective for stages 1-3)."""
        if self.stage == 0:
            return u.master.clone()
        self._fence()
        out = torch.empty(u.layout.padded)
        dist.all_gather_into_tensor(out, u.master.clone(), self.sgroup)
        return out
