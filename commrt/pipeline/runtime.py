"""Schedules that run training steps over ``PipelineStage`` objects, torch.distributed.pipelining
style: ``schedule.step(x, target=y, losses=out)`` on the first and last stages, ``schedule.step()``
in between. The actions are pure data (schedules.py), validated on construction (validate.py);
this module only executes them in order. Each step's receives are posted at its start
(channels.py: from the second step on, one message per tensor list of a known size) so payloads
land while the rank computes, and each action's time goes to ``self.timeline``.

Loss: each micro-batch's loss is scaled by its share of the batch's rows, so for a mean-reduced
loss the accumulated gradients equal the full batch's. Gradients accumulate in ``.grad`` like one
``backward()``; the caller steps its optimizer after ``step()``.
"""
from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_map_only

from commrt import distributed as dist
from commrt.runtime import dtypes
from commrt.runtime.errors import CommError, ConfigError, ProtocolError
from commrt.pipeline import data_parallel, notices
from commrt.pipeline import schedules as S
from commrt.pipeline.channels import Channels
from commrt.pipeline.timeline import WAIT, Timeline
from commrt.pipeline.stage import PipelineStage
from commrt.pipeline.validate import validate
from commrt.train.collector import ManualGC

log = logging.getLogger(__name__)


@dataclass
class _Slot:
    """One micro-batch on one stage, from its forward until its backward has sent its gradients."""
    inputs: list = field(default_factory=list)  # as the module gets them (_entries)
    received: list = field(default_factory=list)  # the activations as received
    cells: list = field(default_factory=list)  # per received tensor, its gradient once backward ran
    outputs: list = field(default_factory=list)
    loss: torch.Tensor | None = None
    grads_out: list | None = None  # gradients of the outputs, received from the next stage
    grads_in: list | None = None  # gradients of the inputs, for the previous stage
    extra: dict = field(default_factory=dict)  # what a subclass keeps per micro-batch


def _check_sendable(stage: int, mb: int, outputs: list) -> None:
    """Refuse, naming it, a stage output the wire cannot carry: said here, not as an
    AttributeError or a TypeError from deep inside the send."""
    bad = next((i for i, o in enumerate(outputs) if not isinstance(o, torch.Tensor)), None)
    if bad is not None:
        raise ConfigError(f"stage {stage}, micro-batch {mb}: output {bad} is {type(outputs[bad]).__name__}, "
                          f"not a tensor; a stage that sends returns a tensor or a tuple of tensors")
    bad = next((i for i, o in enumerate(outputs) if dtypes.dtype_name(o.dtype) not in dtypes.CODES), None)
    if bad is not None:
        raise ConfigError(f"stage {stage}, micro-batch {mb}: output {bad} is a {outputs[bad].dtype} tensor, "
                          f"which cannot be sent to the next stage; valid dtypes: {list(dtypes.CODES)}")


def _tag(dst_stage: int, forward: bool) -> int:
    """One tag per (destination stage, direction): each is a first-in-first-out channel, which is
    the model validate() checks the schedule against."""
    return 2 * dst_stage + (0 if forward else 1)


class PipelineSchedule:
    """Runs one rank's actions of ``actions`` (one list per group rank) over its ``stages``."""
    _batches = 1
    _copy_inputs = False  # True: the module gets copies of what was received (a recompute needs it intact)

    def __init__(self, stages: list[PipelineStage], num_microbatches: int, loss_fn, actions,
                 manual_gc_interval: int = 0):
        # Python's collector between steps (TrainConfig.manual_gc_interval): a stage collecting
        # mid-step stalls the stages waiting on it
        self.collector = ManualGC(manual_gc_interval)
        self.stages = {s.stage_index: s for s in stages}
        self.num_microbatches, self.loss_fn, self.actions = num_microbatches, loss_fn, actions
        any_stage = stages[0]
        self.num_stages, self.group = any_stage.num_stages, any_stage.group
        if loss_fn is None and self.num_stages - 1 in self.stages:
            raise ConfigError(f"stage {self.num_stages - 1} is the last: its schedule needs a loss_fn(output, target)")
        if len(actions) != any_stage.group_size:
            raise ConfigError(f"schedule has {len(actions)} ranks, the group {any_stage.group_size}")
        validate(actions)
        self.rank_actions = actions[dist.get_rank(self.group)]
        mine = {a.stage for a in self.rank_actions}
        if mine != set(self.stages):
            raise ConfigError(f"this rank runs stages {sorted(mine)} but was given {sorted(self.stages)}")
        self.peak_in_flight: dict[int, int] = {}
        for st in stages:
            data_parallel.check(st.module)
        data_parallel.agree_on_steps(stages, self.group)
        self._recv_plan = [(self._peer_rank(a), _tag(a.stage, a.kind == S.RECV_F))
                           for a in self.rank_actions if a.kind in (S.RECV_F, S.RECV_B)]
        self._send_plan = collections.Counter(self._send_dst(a) for a in self.rank_actions
                                              if a.kind in (S.SEND_F, S.SEND_B))
        # in every message: a peer built with other counts fails on its first receive (ConfigError)
        # instead of waiting for a micro-batch this rank never sends
        self._config = (num_microbatches, self.num_stages, self._batches)
        self._current: S.Action | None = None  # the action running, for a failure's notice
        self._failed: BaseException | None = None  # what stopped a step: no step runs after it
        self._backwards = {s: sum(1 for a in self.rank_actions if a.stage == s and a.kind == S.B) for s in self.stages}
        self.timeline = Timeline()
        self._chan = Channels(self.group)  # remembers each message's layout from step to step
        self._ops = {S.SEND_F: self._send, S.SEND_B: self._send, S.RECV_F: self._recv, S.RECV_B: self._recv,
                     S.F: self._compute, S.B: self._compute}

    def _peer_rank(self, a: S.Action) -> int:
        """Global rank of the stage a receive action takes its message from."""
        return self.stages[a.stage].rank_of(a.stage - 1 if a.kind == S.RECV_F else a.stage + 1)

    def _send_dst(self, a: S.Action) -> tuple[int, int]:
        """(global rank, tag) a send action posts to."""
        fwd = a.kind == S.SEND_F
        dst = a.stage + 1 if fwd else a.stage - 1
        return self.stages[a.stage].rank_of(dst), _tag(dst, fwd)

    # -- one training step -------------------------------------------------------------------
    def step(self, *args, target=None, losses: list | None = None):
        """Run every action of this rank; returns the last stage's outputs (the first of a tuple),
        concatenated (stacked when each micro-batch's is a scalar); a last stage that returns
        something else (a dict) gets the list of what it returned per micro-batch, detached."""
        if self._failed is not None:
            raise CommError(f"an earlier step failed ({self._failed!r}); its receives are still posted and its "
                            "messages in flight on this group, so a later step would take them for its own: "
                            "build the schedule on a new group (commrt.new_group) to go on")
        self._slots: dict[tuple[int, int], _Slot] = {}
        self._sends, self._outs, self._losses = [], {}, losses
        self.peak_in_flight = {s: 0 for s in self.stages}
        self._backwards_left = dict(self._backwards)
        self.timeline = Timeline()
        self._current, failed = None, None
        try:
            # receives first: a neighbour's sends of this step then complete over gloo (which sends
            # only into a posted receive) even when this rank's inputs are refused just below
            self._chan.begin(self._recv_plan)
            self._inputs = self._chunks(args, 0, "inputs")
            self._targets = self._chunks((target,) if target is not None else (), self.num_stages - 1, "target")
            self._rows = None if self._targets is None else target.shape[0]
            for a in self.rank_actions:
                self._current = a
                self._run(a)
        except BaseException as exc:
            failed = exc
            if isinstance(exc, Exception):  # the ranks waiting on this one raise now, not at their deadline
                notices.tell(self._chan, self._send_plan, exc, self._current, self._sends)
            self._failed = exc
            raise
        finally:
            try:
                self._wait_sends(failed)
            except BaseException as exc:  # a send that failed alone fails the step as well
                self._failed = exc
                raise
            finally:
                self.timeline.finish()
        self.collector.step()
        if self._outs:  # one value per micro-batch (a last stage computing its own loss) is stacked
            outs = [self._outs[m] for m in sorted(self._outs)]
            if not all(isinstance(o, torch.Tensor) for o in outs):
                return outs  # what the module returned, per micro-batch
            return torch.cat(outs) if outs[0].dim() else torch.stack(outs)
        return None

    def close(self) -> None:
        """Turn Python's automatic collector back on (``manual_gc_interval``; it stays off while
        another schedule or engine of the process still collects at its steps)."""
        self.collector.close()

    def _wait_sends(self, failed: BaseException | None) -> None:
        """Wait for this step's sends. After a failure a send often fails too (the peer went
        away with it); raising that from step()'s ``finally`` would hide the cause, so it is
        attached to the original error as a note and logged instead. A send still pending then
        is left to the transport (which holds its memory): its reader may have stopped too and
        never take it, and over gloo, which sends only into a posted receive, waiting for it
        would last the whole deadline."""
        for h in self._sends:
            if failed is not None and not h.is_completed():
                continue  # its reader may never take it (it stopped too); the transport keeps its memory
            try:
                h.wait()
            except Exception as err:
                if failed is None:
                    raise
                failed.add_note(f"while unwinding, a pipeline send also failed: {err!r}")
                log.warning("pipeline step failed with %r; a pending send also failed: %r", failed, err)

    def _chunks(self, tensors, stage: int, what: str):
        if stage not in self.stages:
            return None
        if not tensors:
            raise ConfigError(f"stage {stage} needs its {what} in step()")
        bad = next((i for i, t in enumerate(tensors) if not isinstance(t, torch.Tensor)), None)
        if bad is not None:
            name = what if what == "target" else f"input {bad}"
            raise ConfigError(f"stage {stage}: {name} must be a tensor to be cut into micro-batches, got "
                              f"{type(tensors[bad]).__name__}")
        if len({t.shape[0] if t.dim() else -1 for t in tensors}) > 1 or not tensors[0].dim():
            raise ConfigError(f"{what}: every tensor needs the same number of rows (dimension 0) to be cut into "
                              f"micro-batches alike; got shapes {[tuple(t.shape) for t in tensors]}")
        per = self.num_microbatches // self._batches  # PipeDream: several batches, each split alike
        parts = [[q for b in torch.tensor_split(t, self._batches) for q in torch.tensor_split(b, per)]
                 for t in tensors]
        if any(p.shape[0] == 0 for p in parts[0]):
            raise ConfigError(f"{what}: {tensors[0].shape[0]} rows cannot make {self.num_microbatches} micro-batches")
        return [tuple(p[m] for p in parts) for m in range(self.num_microbatches)]

    def _run(self, a: S.Action) -> None:
        self._ops.get(a.kind, self._compute)(a)

    def _compute(self, a: S.Action) -> None:
        kind = a.kind
        self._chan.pump()  # payloads whose header has come start landing during this computation
        t0 = time.perf_counter()
        if kind == S.F:
            self._forward(a.stage, a.mb)
        elif kind == S.B:
            self._backward(a.stage, a.mb)
        else:
            self._other(a)
        self.timeline.add(kind, a.stage, a.mb, t0, time.perf_counter())

    def _other(self, a: S.Action) -> None:
        raise ConfigError(f"{type(self).__name__} cannot run action {a}")

    # -- transfers -------------------------------------------------------------------------
    def _send(self, a: S.Action) -> None:
        fwd = a.kind == S.SEND_F
        slot = self._slots[(a.stage, a.mb)]
        data = slot.outputs if fwd else slot.grads_in
        self._sends.append(self._chan.send(data, *self._send_dst(a), (a.stage, a.mb, *self._config)))
        if not fwd:
            del self._slots[(a.stage, a.mb)]  # the micro-batch is done on this stage

    def _recv(self, a: S.Action) -> None:
        fwd = a.kind == S.RECV_F
        src, src_rank = a.stage - 1 if fwd else a.stage + 1, self._peer_rank(a)
        t0 = time.perf_counter()
        meta, tensors = self._chan.take(src_rank, _tag(a.stage, fwd))
        self.timeline.add(WAIT, a.stage, a.mb, t0, time.perf_counter())
        if notices.is_notice(meta):
            raise notices.error_of(a, src_rank, meta, tensors)
        if tuple(meta[2:]) != self._config:
            raise ConfigError(f"rank {dist.get_rank()} runs {notices.describe(self._config)} a step, but stage {src} "
                              f"on rank {src_rank} sent micro-batch {meta[1]} of {notices.describe(meta[2:])}: every "
                              f"rank's schedule must be built with the same counts")
        if tuple(meta[:2]) != (src, a.mb):
            raise ProtocolError(f"stage {a.stage} ({a}) expected micro-batch {a.mb} from stage {src}, got "
                                f"stage {meta[0]} micro-batch {meta[1]}")
        slot = self._slots.setdefault((a.stage, a.mb), _Slot())
        if fwd:
            slot.received = tensors
        else:
            slot.grads_out = tensors

    # -- computation -------------------------------------------------------------------------
    def _forward(self, stage: int, mb: int) -> None:
        slot = self._slots.setdefault((stage, mb), _Slot())
        if stage == 0:
            slot.inputs = list(self._inputs[mb])
        else:
            slot.inputs, slot.cells = _entries(slot.received, self._copy_inputs)
        out = self._call(stage, mb, slot)
        slot.outputs = list(out) if isinstance(out, (tuple, list)) else [out]
        if stage < self.num_stages - 1:
            _check_sendable(stage, mb, slot.outputs)
        if stage == self.num_stages - 1:
            first = slot.outputs[0]  # a dict (Hugging Face style) is kept whole, its tensors detached
            self._outs[mb] = first.detach() if isinstance(first, torch.Tensor) else tree_map_only(
                torch.Tensor, torch.Tensor.detach, out)
            (tgt,) = self._targets[mb]
            loss = self.loss_fn(out, tgt)
            slot.loss = loss * self._loss_scale(tgt)
            if self._losses is not None:
                self._losses.append(loss.detach())
        live = sum(1 for (s, _), sl in self._slots.items() if s == stage and sl.outputs)
        self.peak_in_flight[stage] = max(self.peak_in_flight[stage], live)

    def _loss_scale(self, target: torch.Tensor) -> float:
        """The micro-batch's share of its batch's rows."""
        return target.shape[0] / self._rows

    def _call(self, stage: int, mb: int, slot: _Slot):
        return self.stages[stage].module(*slot.inputs)

    def _backward(self, stage: int, mb: int) -> None:
        slot = self._slots[(stage, mb)]
        self._backwards_left[stage] = left = self._backwards_left.get(stage, 1) - 1
        module = self.stages[stage].module
        if slot.loss is not None:
            data_parallel.backward(module, [slot.loss], None, sync=left == 0)
        else:
            _check_grads(stage, mb, slot.outputs, slot.grads_out)
            pairs = [(o, g) for o, g in zip(slot.outputs, slot.grads_out) if o.requires_grad and g.numel()]
            if pairs:  # the stage's last backward also reduces over its data-parallel replicas
                data_parallel.backward(module, [o for o, _ in pairs], [g for _, g in pairs], sync=left == 0)
        slot.grads_in = [cell[0] if cell else torch.empty(0) for cell in slot.cells]
        slot.outputs, slot.loss, slot.grads_out = [], None, None  # free the activations now
        if stage == 0:
            del self._slots[(stage, mb)]


def _entries(received: list, copy: bool) -> tuple[list, list]:
    """The received activations as the stage's module gets them, and per tensor a cell that
    its backward fills with the tensor's gradient (for the previous stage).

    As an autograd leaf, a received tensor could not be modified in place (RuntimeError from an
    ``nn.ReLU(inplace=True)`` first in the stage), which a single process allows. So a float
    tensor enters the graph as a non-leaf: an in-place subtraction of a zero leaf (exact for
    every value, -0.0 and NaN included; no copy, unlike ``clone()``, so the activation is not
    held twice while it waits for its backward), and its gradient is taken by a hook registered
    before the module runs, which autograd calls with the gradient of the values as received
    even when the module changes them in place. ``copy``: enter a copy, leaving ``received``
    intact for a later recompute (PipeDream without weight stashing)."""
    inputs, cells = [], []
    for t in received:
        cell: list = []
        if t.is_floating_point():
            t = (t.clone() if copy else t).detach()
            t.sub_(torch.zeros((), dtype=t.dtype, requires_grad=True))
            t.register_hook(cell.append)
        inputs.append(t)
        cells.append(cell)
    return inputs, cells


def _check_grads(stage: int, mb: int, outputs: list, grads: list) -> None:
    """The next stage sends one gradient per output of ours, empty where it has none (an output
    that needs no gradient, or one it did not use). Any other size means the stages disagree on
    the model, and dropping that gradient would train on a silently wrong one."""
    if len(grads) != len(outputs) or any(g.numel() and g.shape != o.shape for o, g in zip(outputs, grads)):
        raise ProtocolError(f"pipeline stage {stage}, micro-batch {mb}: gradients received from stage {stage + 1} "
                            f"have shapes {[tuple(g.shape) for g in grads]}, expected the outputs' "
                            f"{[tuple(o.shape) for o in outputs]} (or empty for an output without gradient)")


class GPipe(PipelineSchedule):
    """All forwards, then all backwards (Huang et al. 2019): every micro-batch's activations live
    at once."""

    def __init__(self, stage: PipelineStage, num_microbatches: int, loss_fn=None, manual_gc_interval: int = 0):
        super().__init__([stage], num_microbatches, loss_fn, S.gpipe_actions(stage.num_stages, num_microbatches),
                         manual_gc_interval)


class OneFOneB(PipelineSchedule):
    """1F1B with a flush per step (PipeDream-Flush, Narayanan et al. 2021): at most
    ``num_stages - stage`` micro-batches in flight on a stage."""

    def __init__(self, stage: PipelineStage, num_microbatches: int, loss_fn=None, manual_gc_interval: int = 0):
        super().__init__([stage], num_microbatches, loss_fn,
                         S.one_f_one_b_actions(stage.num_stages, num_microbatches), manual_gc_interval)


class Interleaved1F1B(PipelineSchedule):
    """Several stages per rank (Megatron-LM's interleaved 1F1B): stage s on group rank s % P."""

    def __init__(self, stages: list[PipelineStage], num_microbatches: int, loss_fn=None,
                 manual_gc_interval: int = 0):
        ranks = stages[0].group_size
        per_rank = stages[0].num_stages // ranks
        if len(stages) != per_rank:
            raise ConfigError(f"Interleaved1F1B: this rank holds {per_rank} of the {stages[0].num_stages} stages, "
                              f"got {len(stages)}")
        super().__init__(stages, num_microbatches, loss_fn, S.interleaved_actions(ranks, num_microbatches, per_rank),
                         manual_gc_interval)
