"""``commrt.train.initialize(model=..., config=...)``: DeepSpeed's engine interface over commrt.

    engine = commrt.train.initialize(model=model, config={"zero_optimization": {"stage": 2},
                                                          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    loss = loss_fn(engine(x), y)
    engine.backward(loss)
    engine.step()
"""
from __future__ import annotations

import contextlib
import copy
import weakref
from typing import Any, Mapping

import torch
from torch import nn

from commrt import distributed as dist
from commrt.runtime.errors import CommError, ConfigError
from commrt.train import groups, sharding
from commrt.train.breakdown import StepBreakdown
from commrt.train.collector import ManualGC
from commrt.train.config import TrainConfig
from commrt.train.gather_hooks import GatherHooks
from commrt.train.learning_rate import LearningRate
from commrt.train.engine_checks import GradientCheck
from commrt.train.engine_state import EngineState
from commrt.train.units import UnitState
from commrt.train.zero import Zero, ZeroSettings
from commrt.train.zero_step import drop_grads, drop_prefetches


def _cast(x, dtype: torch.dtype):
    """A floating tensor in ``dtype``, inside tuples, lists and dicts too (DeepSpeed's
    ``_cast_inputs_half``): a batch passed as ``(x, y)`` or ``{"x": x}`` met bf16 weights in
    fp32. Integer tensors (token ids, masks) and everything else pass as they are."""
    if torch.is_tensor(x):
        return x.to(dtype) if x.is_floating_point() else x
    if isinstance(x, dict):
        out = copy.copy(x)  # the caller's type (OrderedDict, defaultdict), not the caller's object
        for k, v in x.items():
            out[k] = _cast(v, dtype)
        return out
    if isinstance(x, (list, tuple)):
        items = [_cast(v, dtype) for v in x]
        return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)  # a namedtuple's fields
    return x


class NonFiniteGradients(CommError):
    """A rank produced NaN or inf gradients and the policy is 'raise'."""


class EngineClosed(CommError):
    """A call that trains or loads through an engine after its ``close()``."""


def initialize(model: nn.Module, config: Mapping[str, Any] | TrainConfig | None = None,
               group=None) -> "Engine":
    cfg = config if isinstance(config, TrainConfig) else TrainConfig.from_dict(config)
    if cfg.fault_tolerance == "replica":  # else the setting would be silently without effect
        raise ConfigError("fault_tolerance = 'replica' is not run by the ZeRO engine: drive the training loop with "
                          "commrt.train.replica_ft.ReplicaFT (README: 'Surviving a lost replica'), as "
                          "workers.train_lm does, or set fault_tolerance = 'off'")
    return Engine(model, cfg, group)


_OPEN: "weakref.WeakSet[Engine]" = weakref.WeakSet()
"""The engines of this process not closed yet: their gradient hooks are on their parameters, so a
second engine on one of them would reduce its gradients twice (``_check_not_held``)."""


def _check_not_held(model: nn.Module) -> None:
    mine = {id(p) for p in model.parameters()}
    for other in list(_OPEN):
        if not other.closed and any(id(p) in mine for p in other.params):
            raise ConfigError(f"{type(model).__name__} (or a module sharing its parameters) is held by an open "
                              "engine, whose hooks would reduce its gradients too; call close() on that engine "
                              "first (every rank), then initialize the new one")


class Engine(GatherHooks, LearningRate, GradientCheck, EngineState):
    def __init__(self, model: nn.Module, cfg: TrainConfig, group=None):
        _check_not_held(model)  # no collective yet: every rank raises alike
        self.module, self.cfg, self.group = model, cfg, group
        cfg.check_batch(dist.get_world_size(group))  # before any collective: every rank raises alike
        self.dtype = torch.bfloat16 if cfg.bf16 else torch.float32
        src = group.ranks[0] if group is not None else 0
        with torch.no_grad():  # every replica starts from rank 0's values
            for t in [*model.parameters(), *model.buffers()]:
                if t.is_floating_point() and t.dtype != self.dtype:
                    t.data = t.data.to(self.dtype)
                dist.broadcast(t.data, src, group)
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for p in model.parameters() if p.requires_grad]
        z = cfg.zero
        auto = "auto" in (z.sharding_strategy, z.zero_hpz_partition_size)
        links = groups.measure_links() if auto and group is None else None
        self.plan = sharding.plan(z, dist.get_world_size(group), groups.ranks_per_node(), links)
        settings = ZeroSettings(self.plan.stage, cfg.optimizer, self.dtype, z.reduce_bucket_size, z.overlap_comm,
                                qwz=z.zero_quantized_weights, qgz=z.zero_quantized_gradients,
                                loco=z.zeropp_loco_param,
                                # clipping needs the global norm before any unit steps
                                overlap_step=z.overlap_step and cfg.gradient_clipping <= 0)
        self.zero = Zero(model, self.params, settings, group, groups.build(self.plan, group))
        self.collector = ManualGC(cfg.manual_gc_interval)  # Python's collector between steps
        self.global_steps = 0      # optimizer steps taken
        self.skipped_steps = 0     # boundaries skipped for non-finite gradients
        self._norm_group = None  # reduce_norm_over: the other holders of the model's parts
        self.micro_steps = 0
        self.reduced_during_backward = 0  # units whose reduction a gradient hook started
        self.prefetched = 0  # stage-3 gathers started ahead of their module's use (the overlap)
        self.clock = self.zero.clock
        self._no_sync = False
        self.closed = False  # close() ran: the engine still reads its state, but trains nor loads
        self._dirty = False  # a backward ran since the last step (zero_grad has something to drop)
        self._sync_now = True
        self._next_unit = 0  # stages 0-2: the unit whose reduction starts next (index order)
        self._hooks = []
        self._unit_of = {}
        self._order: list[UnitState] = []  # stage 3: units in the order the first forward ran them
        self._gathers = False  # stage 3 with gathers: the hooks below, and the root's (__call__)
        self._next: dict[int, UnitState] = {}
        self._prev: dict[int, UnitState] = {}
        for u in self.zero.units:
            for p in u.params:
                self._unit_of[id(p)] = u
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
        if self.plan.stage == 3 and not self.zero.resident:  # resident: nothing to gather
            self._install_gather_hooks(model)
        self._schedule_lr()
        _OPEN.add(self)  # last: an initialize that raised holds nothing

    # -- forward / backward / step ----------------------------------------------------------
    def __call__(self, *args, **kwargs):
        if self.dtype != torch.float32:  # keyword inputs too: engine(x=...) met bf16 weights in fp32
            args = tuple(_cast(a, self.dtype) for a in args)
            kwargs = {k: _cast(v, self.dtype) for k, v in kwargs.items()}
        with self.clock.span("forward"):
            if not self._gathers:
                return self.module(*args, **kwargs)
            return self._gathering_forward(args, kwargs)

    forward = __call__

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.cfg.gradient_accumulation_steps == 0

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss / gradient_accumulation_steps``; bucket reductions start inside."""
        self._check_open("backward")
        self._check_trainable()
        self._dirty = True  # gradients a step has not consumed yet (zero_grad drops them)
        with self.clock.span("backward"):
            self._backward(loss)
        self.micro_steps += 1

    def _check_open(self, call: str) -> None:
        if self.closed:
            raise EngineClosed(f"engine.{call}() after close(): the model is a plain torch module again; "
                               "initialize a new engine on it to train it with the engine")

    def _check_trainable(self) -> None:
        """The parameters that train are fixed at initialize (they are the units' flat buffers and
        optimizer state): one frozen after it would still be stepped (a zero gradient moves it by
        AdamW's momentum and weight decay, where torch skips a parameter without ``.grad``), and
        one unfrozen after it would get gradients no step applies. Refused, before any backward."""
        for name, p in zip(self.names, self.params):
            if not p.requires_grad:
                raise ConfigError(f"parameter {name} was frozen (requires_grad False) after initialize; freeze "
                                  "parameters before initialize: the engine's units are fixed at initialize")
        if sum(p.requires_grad for p in self.module.parameters()) > len(self.params):
            late = [n for n, p in self.module.named_parameters() if p.requires_grad and n not in self.names]
            raise ConfigError(f"parameter(s) {late} were unfrozen (requires_grad True) after initialize; set "
                              "requires_grad before initialize: the engine's units are fixed at initialize")

    def _backward(self, loss: torch.Tensor) -> None:
        stage = self.zero.stage
        self._sync_now = stage >= 2 or (self.is_gradient_accumulation_boundary() and not self._no_sync)
        for u in self.zero.units:
            u.pending = len(u.params)
        self._next_unit = 0
        self.zero.begin_backward()
        if self._gathers:  # what the model's own forward read (released by their reduction)
            for v in self._outside[self._root]:
                self.zero.gather(v)
        (loss / self.cfg.gradient_accumulation_steps).backward()
        with self.clock.span("bookkeeping"):
            if self._sync_now:  # units whose parameters got no gradient still take part
                if self.zero.stage < 3:
                    self._reduce_in_order(flush=True)
                for u in self.zero.units:
                    if 0 < u.pending:
                        self.zero.reduce(u)
                        u.pending = 0
            if self.zero.defer:  # zero_defer: the replica all-reduces land during the next forward
                self.zero.issue_backward()
            else:
                self.zero.wait()
            self._learn_order()

    def _on_grad(self, p: nn.Parameter) -> None:
        if not self._sync_now:
            return  # accumulate locally (no_sync, or not yet the accumulation boundary)
        u = self._unit_of[id(p)]
        u.pending -= 1
        if u.pending == 0 and self.zero.stage < 3:
            self._reduce_in_order()
        elif u.pending == 0:  # stage 3: every rank gathered the same units, so it reduces them alike
            with self.clock.span("bookkeeping"):
                self.zero.reduce(u)
            self.reduced_during_backward += 1  # started while backward runs: the overlap

    def _reduce_in_order(self, flush: bool = False) -> None:
        """Stages 0-2: start the units whose gradients are all in, in index order only, as torch
        DDP does: every rank's n-th reduction must be the same unit whatever order its hooks
        fired in (a parameter only some ranks' forward used completes its unit at the flush
        there; a unit of the same size started before it was averaged crosswise, no error).
        ``flush``: after backward, the rest too (their missing gradients count as zeros)."""
        units = self.zero.units
        while self._next_unit < len(units) and (flush or units[self._next_unit].pending == 0):
            u = units[self._next_unit]
            self._next_unit += 1
            with self.clock.span("bookkeeping"):
                self.zero.reduce(u)
            u.pending = 0
            self.reduced_during_backward += not flush  # started while backward runs: the overlap

    @contextlib.contextmanager
    def no_sync(self):
        """Skip the gradient reduction for the backward passes inside (stages 0-1; stages 2-3
        still reduce-scatter every micro-step into the shards, which is what keeps their
        gradient memory at 1/N: the accumulated result is the same)."""
        old, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = old

    def zero_grad(self) -> None:
        """Drop the gradients no ``step()`` consumed yet, as torch's ``optimizer.zero_grad()`` and
        DeepSpeed's ``engine.zero_grad()``: after a backward that raised (caught by the loop on
        every rank: every rank calls it), whose reductions had partly started and whose
        gradients the next step would otherwise add in. Waits for the reductions in flight;
        the accumulation count (``micro_steps``) is left as it is. After ``step()`` there is
        nothing to drop and it returns at once."""
        self._check_open("zero_grad")
        if self._dirty:
            with self.clock.span("bookkeeping"):
                drop_grads(self.zero)
            self._dirty = False

    def step(self) -> bool:
        """Apply the optimizer at an accumulation boundary; returns whether a step was taken."""
        self._check_open("step")
        if self.micro_steps % self.cfg.gradient_accumulation_steps or self._no_sync:
            return False
        try:
            with self.clock.span("optimizer"):
                took = self._step()
        finally:  # a step that raised (NonFiniteGradients) is reported, not added to the next one
            self.clock.finish_step()
        self.collector.step()  # outside the breakdown's step, inside the caller's
        return took

    def close(self) -> None:
        """End the engine: the model is a plain torch module again, holding the trained values
        (stage 3: gathered from the shards, a collective: every rank calls it), without the
        engine's gradient and module hooks, which otherwise took a later plain loop's gradients
        and released its parameters after each forward; the comm stream ends. Python's automatic
        collector is turned back on (``manual_gc_interval``: it stays off while an engine or
        schedule of the process still collects at its steps). Twice: nothing more. The closed
        engine still reads (``full_state_dict``, ``state_dict``, ``save_checkpoint``); a call
        that would train or load through it raises ``EngineClosed``: at stage 3 it released the
        module's parameters, at every stage it wrote over what the plain module had become."""
        self.closed = True
        _OPEN.discard(self)  # the hooks go below: the module may get a new engine
        if self._hooks:
            self.zero.settle_all()
            self.zero.wait()
            for h in self._hooks:
                h.remove()
            self._hooks = []
            if self._gathers:
                self._gathers = False
                drop_prefetches(self.zero)
                for u in self.zero.units:  # the exact fp32 values, not a qwZ gather's
                    u.full = self.zero.full_master(u).to(self.dtype)
                    u.views(u.full)
            if self.zero.stream is not None:  # its queue is empty: later reads use the groups directly
                self.zero.stream.close()
                self.zero.stream = None
        self.collector.close()

    def settle(self) -> None:
        """Finish the last step now: with ``overlap_step`` (hybrid stage 3) its replica
        all-reduces still cross and each unit steps at its next gather; after this, every byte
        of the step has been sent and every unit stepped (checkpoints and ``full_state_dict``
        do this themselves). Without it, nothing to do."""
        self.zero.settle_all()

    def step_breakdown(self) -> StepBreakdown | None:
        """Where the last optimizer step's time went (None before the first step); a step that
        was skipped or raised (``non_finite_grads``) counts as one, so the next starts afresh."""
        return self.clock.last

    def _step(self) -> bool:
        with self.clock.span("bookkeeping"):
            if self.zero.defer:
                self.zero.issue_backward()
            else:
                self.zero.wait()
            bad, norm, lrs = self._check_gradients()
        self._dirty = False  # consumed: stepped, or dropped as non-finite
        if len(set(lrs)) > 1:
            drop_grads(self.zero)
            raise ConfigError(f"the ranks' learning rates differ before step {self.global_steps + 1}: "
                              f"{dict(enumerate(lrs))}; every rank must call set_lr with the same value "
                              "before the same step; no update was applied")
        if bad:
            drop_grads(self.zero)  # every reduction landed before the gradients are dropped
            if self.cfg.non_finite_grads == "raise":
                raise NonFiniteGradients(f"non-finite gradients on rank(s) {bad} before step "
                                         f"{self.global_steps + 1}; no update was applied")
            self.skipped_steps += 1
            return False
        clip = self.cfg.gradient_clipping
        coef = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0  # as torch.nn.utils.clip_grad_norm_
        self.global_steps += 1
        if self.zero.defer:  # each unit steps at its next gather (zero_defer)
            self.zero.defer_update(self.global_steps, coef)
        else:
            self.zero.update(self.global_steps, coef)  # its publish is bookkeeping and comm
        self.last_grad_norm = norm
        self._schedule_lr()  # the next step's (a deferred step keeps its own: zero_defer's due_spec)
        return True
