"""ZeRO stages 0-3 over commrt collectives (Rajbhandari et al., "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models", 2020).

Every trainable parameter belongs to a unit (``layout.Unit``): one flat buffer, sharded evenly.

    stage 0  every rank keeps everything; gradients all-reduced; every rank steps everything
    stage 1  + optimizer state and the fp32 master values only for the own shard; gradients
             reduce-scattered into each rank's shard (all-reduced with hybrid sharding, qgZ or
             bf16), each rank steps its shard, then the units are all-gathered
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

One gradient, stages 2-3: ``Engine._on_grad`` (the parameter's post-accumulate hook) counts the
unit down; the last one calls ``Zero.reduce`` (stage 2: once every unit before it has started
too, ``Engine._reduce_in_order``: one order on every rank), which flattens the unit's gradients
(``_flatten_grads``), starts ``_start_reduce_scatter`` (here or on the comm stream) and queues
``shard_reduced`` to run when it is done; that adds the shard into ``UnitState.grad`` (hybrid:
first ``_start_replica_all_reduce``, then ``replica_reduced``; with ``overlap_comm`` the two are
one ``stream.Chained``, whose replica all-reduce the reduce-scatter's own thread starts, and
``replica_reduced`` is queued directly). ``Engine.step`` waits for the queue and calls
``Zero.update`` (``zero_step.py``), which steps the fp32 master shard.
"""
from __future__ import annotations

import functools
import time
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from commrt import distributed as dist
from commrt import quant as cq
from commrt.collectives.reduce_ops import ReduceOp
from commrt.optim import rules as optim
from commrt.train import zero_step
from commrt.train.zero_step import all_finite
from commrt.train.breakdown import StepClock, trace_sink
from commrt.train.followups import Followup, run_all, run_ready
from commrt.train.groups import ShardGroups
from commrt.train.layout import FIRST_BUCKET_BYTES, Unit, make_unit
from commrt.train.stream import Chained, CommStream
from commrt.train.units import UnitState, make_units
from commrt.train.zero_defer import Deferring
from commrt.train.zero_gather import Gathering


@dataclass(frozen=True)
class ZeroSettings:
    """What ``Zero`` needs from the training config (``Engine`` derives it from ``TrainConfig``
    and the sharding plan)."""
    stage: int
    optimizer: optim.OptimSpec
    dtype: torch.dtype = torch.float32     # compute and communication dtype (master stays fp32)
    bucket_size: int = 6_553_600           # elements per gradient bucket (stages 0-2)
    overlap: bool = True                   # reduce from the hooks while backward runs
    qwz: bool = False                      # ZeRO++: stage-3 gathers in int8
    qgz: bool = False                      # ZeRO++: gradient reductions in int4
    loco: dict | None = None               # ZeRO++: LoCo error feedback of the int4 gradients
    overlap_step: bool = False             # hybrid stage 3: units step at their next gather (zero_defer)


class Zero(Gathering, Deferring):
    """The per-rank state and communication of one ZeRO-sharded model (used by ``Engine``)."""

    def __init__(self, model: nn.Module, params: list[nn.Parameter], settings: ZeroSettings,
                 group=None, groups: ShardGroups = ShardGroups()):
        s = self.settings = settings
        self.stage, self.spec, self.dtype, self.group = s.stage, s.optimizer, s.dtype, group
        self.overlap, self.qwz, self.qgz, self.loco = s.overlap, s.qwz, s.qgz, s.loco
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.sgroup = groups.shard if groups.shard is not None else group
        self.rgroup, self.hgroup = groups.replica, groups.secondary
        self.shard_rank, self.shards = dist.get_rank(self.sgroup), dist.get_world_size(self.sgroup)
        # with replicas, one copy of each shard counts towards the global gradient norm
        self.counts_norm = self.rgroup is None or dist.get_rank(self.rgroup) == 0
        self.works: list[Followup] = []
        self.clock = StepClock(trace_sink())  # the engine's phases and these hooks' spans: step_breakdown()
        # ZeRO++: quantized compositions run on this thread, beside compute (see the module doc)
        self.stream = CommStream() if s.overlap and (s.qwz or s.qgz) else None
        if self.stream is not None:  # its thread ends with the engine
            weakref.finalize(self, self.stream.close)
        self.started_early = 0  # queued works finished (and follow-ups started) from the hooks, before wait()
        self.nonfinite = False
        self.live_bytes = self.peak_live_bytes = 0
        # stage 3 over one shard (world size 1, or replicas only) in fp32: a gather would copy the
        # master and a release free the copy, around every module, to end where they began; the
        # parameters stay views of the master instead (the optimizer steps them in place)
        self.resident = (s.stage == 3 and self.shards == 1 and not s.qwz and s.dtype == torch.float32
                         and self.hgroup is None)
        # hybrid stage 3 with every unit gathered before use: the step overlaps the link (zero_defer)
        self.defer = (s.overlap_step and s.stage == 3 and self.rgroup is not None and not self.resident
                      and self.stream is None and s.overlap and s.optimizer.kind != "lamb")
        self.late: dict[int, int] = {}  # held units (id) -> their place in forward order
        self.held: list = []            # held units' (unit, reduced shard) until issue_backward
        self.holding = False            # a held unit was reduced in this backward: hold every later one
        self.due_spec = s.optimizer     # the OptimSpec of the step that is due (defer_update)
        self.deferred_steps = self.steps_in_forward = 0
        self.units: list[UnitState] = []
        for idx in make_units(model, params, s.stage, s.bucket_size, self.world,
                              FIRST_BUCKET_BYTES // s.dtype.itemsize):
            lay = make_unit(idx, [params[i].numel() for i in idx], self.world)
            own = (0, lay.padded) if s.stage == 0 else lay.shard(self.shard_rank, self.shards)
            self.units.append(self._build(lay, [params[i] for i in idx], own))

    def _build(self, lay: Unit, params: list[nn.Parameter], own: tuple[int, int]) -> UnitState:
        u = UnitState(lay, params, own)
        flat = u.flat_values()
        lo, hi = own
        if self.stage < 3:
            u.full = flat if self.dtype == torch.float32 else flat.to(self.dtype)
            u.master = u.full[lo:hi] if self.dtype == torch.float32 else flat[lo:hi].clone()
            u.views(u.full)
        elif self.resident:  # the one shard is the whole unit: the parameters view it for good
            u.master = u.full = flat
            u.views(flat)
        else:
            u.master = flat[lo:hi].clone()
            if self.hgroup is not None:
                u.secondary = torch.zeros(lay.padded // dist.get_world_size(self.hgroup), dtype=self.dtype)
            self.release(u)
        u.grad = torch.zeros(lay.padded if self.stage < 2 else hi - lo)
        u.state = optim.init_state(self.spec, u.master)
        u.feedback = cq.ErrorFeedback.from_loco(self.loco) if self.loco is not None else None
        return u

    # -- gradients: hook -> collective -> the unit's gradient --------------------------------
    def reduce(self, u: UnitState) -> None:
        """Hand the unit's local gradients to the collective (from a hook, or a final flush)."""
        if self.world == 1 and not self.qgz:  # the group's average is the gradient itself
            if self.stage < 2 and self.dtype == torch.float32:
                self._flatten_grads(u, into=u.grad)  # in place: p.grad views u.grad from now on
            else:
                self._reduce_alone(u)
            return
        if self.stage == 1 and self.rgroup is None and not self.qgz and self.dtype == torch.float32:
            # each rank steps only its shard: a reduce-scatter into it carries half an all-reduce's bytes
            flat = self._flatten_grads(u)
            own = u.grad[u.own[0]:u.own[1]]
            out = torch.empty_like(own) if u.reduced else own  # a pending reduced gradient is added to
            u.reduced = True
            work = self._issue("reduce_scatter", self._start_reduce_scatter, out, flat, u)
            self._track(work, self.shard_scattered, u, out)
            self.progress()
            return
        if self.stage < 2 and not self.qgz and self.dtype == torch.float32:
            self._flatten_grads(u, into=u.grad)  # reduced where the optimizer reads it: no copy back
            work = self._issue("all_reduce", self._start_all_reduce, u.grad, u)
            self._track(work, self.grad_all_reduced, u, u.grad)
            self.progress()
            return
        flat = self._flatten_grads(u)
        if self.stage < 2:
            work = self._issue("qgZ all_reduce" if self.qgz else "all_reduce", self._start_all_reduce, flat, u)
            self._track(work, self.grad_all_reduced, u, flat)
        else:
            out = torch.empty(u.own[1] - u.own[0], dtype=self.dtype)
            name = "qgZ reduce_scatter" if self.qgz else "reduce_scatter"
            if self.defer:  # zero_defer: its landing is waited for by its next gather
                self._reduce_deferred(u, name, out, flat)
            elif self.stream is not None and self.rgroup is not None:  # one stream task: see _start_hybrid
                work = self._issue(name + " + replica all_reduce", self._start_hybrid, out, flat, u)
                self._track(work, self.replica_reduced, u, out)
            elif self.rgroup is not None and self.overlap:  # the replica all-reduce follows at once
                work = Chained(name + " + replica all_reduce", self._start_reduce_scatter(out, flat, u),
                               functools.partial(self._start_replica_all_reduce, out))
                self._track(work, self.replica_reduced, u, out)
            else:
                work = self._issue(name, self._start_reduce_scatter, out, flat, u)
                self._track(work, self.shard_reduced, u, out)
            if self.stage == 3:
                self.release(u)
        self.progress()

    def begin_backward(self) -> None:
        """Before a backward. A reduced gradient no step consumed yet stays in ``u.grad`` at
        every stage, and the new backward's is added to it, as torch adds a second backward
        into ``p.grad`` without ``zero_grad`` (stages 0-1 used to drop it, 2-3 to add it)."""
        if self.defer:  # units the last forward did not gather: their landing and step first
            self.settle_all()

    def _reduce_alone(self, u: UnitState) -> None:
        """World size 1: what the collective path leaves in ``u.grad``, without the flat copy,
        the collective and the copy back (identical values: an average over one rank is the
        gradient; qgZ, which would quantize it, never comes here)."""
        for p, off, n in zip(u.params, u.layout.offsets, u.layout.numels):
            dst = u.grad[off:off + n]
            if p.grad is None:
                continue
            g = p.grad.reshape(-1)
            dst.add_(g)  # onto zeros after a step, else onto the gradient no step consumed yet
            u.grad_zero = False
            p.grad = None
            if not self.nonfinite and not all_finite(g):
                self.nonfinite = True
        if self.stage == 3:
            self.release(u)

    def _flatten_grads(self, u: UnitState, into: torch.Tensor | None = None) -> torch.Tensor:
        """The unit's gradients in one buffer of the communication dtype: a new one (``p.grad``
        let go), or ``into`` (stages 0-1 in fp32: the unit's gradient buffer itself), which
        ``p.grad`` then views, so later backwards accumulate into it in place as torch DDP's
        ``gradient_as_bucket_view`` does: no copy, and no fresh gradient tensors for autograd
        to allocate and page-fault each step (``update`` zeroes it). A gradient there that no
        step consumed yet stays: this backward's adds to it (in place where ``p.grad`` views it)."""
        if into is None:  # every element is written below: no zero-fill of the whole unit first
            flat = torch.empty(u.layout.padded, dtype=self.dtype)
            flat[u.layout.numel:].zero_()  # the padding
        else:
            flat = into
        for p, off, n in zip(u.params, u.layout.offsets, u.layout.numels):
            g, dst = p.grad, flat[off:off + n]
            if g is None:
                if into is None:
                    dst.zero_()
            elif into is None:
                dst.copy_(g.reshape(-1))
                p.grad = None
            elif g.data_ptr() != dst.data_ptr():  # the first step, or the caller replaced p.grad
                dst.add_(g.reshape(-1))
                p.grad = dst.view(g.shape)
        if not all_finite(flat):
            self.nonfinite = True  # noted before the reduction mixes it into every rank
            if self.qgz:  # the step will be skipped; the codec would refuse the values
                flat.zero_()
        return flat

    def _start_all_reduce(self, flat: torch.Tensor, u: UnitState):
        if self.qgz:
            return cq.all_reduce(flat, ReduceOp.AVG, self.group, True, quant="int4", feedback=u.feedback)
        return dist.all_reduce(flat, ReduceOp.AVG, self.group, async_op=True)

    def _start_reduce_scatter(self, out: torch.Tensor, flat: torch.Tensor, u: UnitState):
        if self.qgz:
            return cq.reduce_scatter_tensor(out, flat, ReduceOp.AVG, self.sgroup, True, quant="int4",
                                            feedback=u.feedback)
        return dist.reduce_scatter_tensor(out, flat, ReduceOp.AVG, self.sgroup, async_op=True)

    def _start_hybrid(self, out: torch.Tensor, flat: torch.Tensor, u: UnitState):
        """On the comm stream: the reduce-scatter, then at once the replica all-reduce. Started
        from ``shard_reduced`` instead, it would enter the stream whenever ``progress`` saw the
        reduce-scatter done, before or after later units' reduce-scatters depending on timing
        (issue 30.22); chained, the stream's order is the hooks' order on every rank."""
        work = self._start_reduce_scatter(out, flat, u)
        if work is not None:
            work.wait()
        return self._start_replica_all_reduce(out)

    def _start_replica_all_reduce(self, out: torch.Tensor):
        return dist.all_reduce(out, ReduceOp.AVG, self.rgroup, async_op=True)

    def grad_all_reduced(self, u: UnitState, flat: torch.Tensor) -> None:
        """Stages 0-1: the group's average is the unit's gradient (reduced in place in fp32),
        added to a reduced gradient no step consumed yet (zeros after a step)."""
        if flat is not u.grad:
            u.grad.add_(flat)

    def shard_scattered(self, u: UnitState, out: torch.Tensor) -> None:
        """Stage 1: the average of this rank's shard is in ``u.grad`` (reduce-scattered there),
        or in ``out`` beside a reduced gradient no step consumed yet, which it is added to."""
        own = u.grad[u.own[0]:u.own[1]]
        if out.data_ptr() != own.data_ptr():
            own.add_(out)

    def shard_reduced(self, u: UnitState, out: torch.Tensor) -> None:
        """Stages 2-3: the shard group's average of this rank's shard arrived; hybrid sharding
        then averages it over the replicas (started here, during backward when it can be)."""
        if self.rgroup is None:
            self._accumulate(u, out)
            return
        work = self._issue("replica all_reduce", self._start_replica_all_reduce, out)
        self._track(work, self.replica_reduced, u, out)

    def replica_reduced(self, u: UnitState, out: torch.Tensor) -> None:
        self._accumulate(u, out)

    @staticmethod
    def _accumulate(u: UnitState, out: torch.Tensor) -> None:
        """Add a reduced shard into ``u.grad``; the first since the step zeroed it becomes
        ``u.grad`` instead (same values, bit for bit: 0 + x = x): adding a whole shard onto
        zeros read and wrote 3x its bytes, 5 ms a step for HYBRID_SHARD /1 at 7.5M parameters."""
        if u.grad_zero and out.dtype == u.grad.dtype and out.shape == u.grad.shape:
            u.grad = out
        else:
            u.grad.add_(out)
        u.grad_zero = False

    # -- the queue of collectives in flight ---------------------------------------------------
    def _issue(self, name: str, start, *args):
        """Start a collective (``start(*args)`` returns its Work): here, or on the comm stream."""
        if self.stream is None:
            return start(*args)
        return self.stream.submit(name, functools.partial(start, *args))

    def fence(self) -> None:
        """Return once the stream has issued everything submitted so far (then this thread may
        call collectives on the same groups without changing their order)."""
        if self.stream is not None:
            self.stream.fence()

    def _track(self, work, then, *args) -> None:
        self.works.append(Followup(work, then, args, time.perf_counter()))
        if not self.overlap:
            self.wait()

    def progress(self) -> None:
        """Finish the works at the front of the queue that are done, without blocking: hybrid's
        cross-replica all-reduce of a unit then starts during backward, as soon as its in-group
        reduce-scatter is done, not after backward (called from the gradient and gather hooks).
        Front first only, so every rank starts the follow-up collectives in the same order."""
        self.started_early += run_ready(self.works, self.clock)

    def wait(self) -> None:
        run_all(self.works, self.clock)  # a followup may start a further collective (hybrid's second step)
        self.fence()
        if self.defer:  # and the replica all-reduces that zero_defer keeps out of the queue
            self.issue_backward()
            for u in self.units:
                self.settle_landing(u)

    def own_grad(self, u: UnitState) -> torch.Tensor:
        return u.grad[u.own[0]:u.own[1]] if self.stage < 2 else u.grad

    def shard_grad(self, u: UnitState) -> torch.Tensor:
        """This rank's 1/world of the gradient (for norms: every element counted once)."""
        if self.stage >= 2:
            return u.grad
        lo, hi = u.layout.shard(self.shard_rank, self.shards)
        return u.grad[lo:hi]

    # -- the optimizer step and consolidated values (zero_step.py) ----------------------------
    def update(self, step: int, clip_coef: float) -> None:
        zero_step.update(self, step, clip_coef)

    def publish(self) -> None:
        zero_step.publish(self)

    def full_master(self, u: UnitState) -> torch.Tensor:
        """The whole unit's fp32 values (a collective for stages 1-3)."""
        self.settle(u)
        return zero_step.full_master(self, u)

