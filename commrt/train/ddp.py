"""``DataParallel``: torch DDP's contract over commrt collectives, for users who keep their own
optimizer.

Gradients are copied into buckets (parameters in reverse registration order, about the order
backward produces them; the first bucket at most 1 MiB, as torch DDP's) and each bucket's
all-reduce starts from the gradient hooks as soon as it and every bucket before it are full (one
order on every rank, whichever parameters each rank's forward used), so communication overlaps
the rest of backward. A parameter that no rank produced a gradient for keeps ``p.grad`` as it
was (None), as torch DDP with ``find_unused_parameters`` leaves it: each bucket carries one
used-flag per parameter, set by any backward since the last reduction (``no_sync`` micro-steps
included, as torch DDP counts them). At the end of backward (an autograd
callback, as torch DDP does) the reductions are waited for and the averaged gradients written
back to ``p.grad``, before the optimizer step. In fp32 (no ``comm_dtype``, no codec) each bucket
is a buffer kept across steps and ``p.grad`` is left a view of it, as with torch DDP's
``gradient_as_bucket_view=True``: a gradient kept past the next backward is overwritten by it.

``comm_quant="int8" | "int4"`` reduces each bucket with the quantized all-reduce (commrt.quant:
block-wise scales, fp32 reduction, bit-identical on every rank), synchronously from the hook
that fills the bucket; ``error_feedback`` keeps each bucket's quantization error for the next
step (True: LoCo with DeepSpeed's err_beta 0.8 / reset_T 1024, or a dict of those keys).
"""
from __future__ import annotations

import contextlib
import functools
import weakref

import torch
from torch import nn

from commrt import distributed as dist
from commrt import quant as cq
from commrt.collectives.reduce_ops import ReduceOp
from commrt.runtime.errors import ConfigError
from commrt.train.breakdown import StepBreakdown, StepClock, trace_sink
from commrt.train.layout import FIRST_BUCKET_BYTES, buckets


class DataParallel(nn.Module):
    def __init__(self, module: nn.Module, group=None, bucket_cap_mb: float = 25,
                 comm_dtype: torch.dtype | None = None, broadcast_buffers: bool = True,
                 comm_quant: str | None = None, error_feedback: bool | dict = False):
        super().__init__()
        if comm_quant is not None:
            cq.codec_for(comm_quant)  # ValueError naming the valid ones
        if error_feedback and comm_quant is None:
            raise ValueError("error_feedback needs comm_quant ('int8' or 'int4')")
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
            raise ConfigError(f"DataParallel bucket_cap_mb = {bucket_cap_mb!r} is invalid; valid: a number > 0")
        if comm_dtype is not None and not (isinstance(comm_dtype, torch.dtype) and comm_dtype.is_floating_point):
            raise ConfigError(f"DataParallel comm_dtype = {comm_dtype!r} is invalid; valid: None or a floating "
                              "torch dtype (torch.bfloat16, torch.float16, torch.float32)")
        self.module, self.group = module, group
        self.comm_dtype, self.comm_quant = comm_dtype, comm_quant
        self.broadcast_buffers = broadcast_buffers
        self._src = group.ranks[0] if group is not None else 0
        with torch.no_grad():  # all replicas start equal
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t.data, self._src, group)
        self._params = [p for p in module.parameters() if p.requires_grad]
        cap = max(1, int(bucket_cap_mb * (1 << 20)) // 4)
        self._buckets = [[self._params[i] for i in u.params]
                         for u in buckets([p.numel() for p in self._params], cap, 1, FIRST_BUCKET_BYTES // 4)]
        self._slot = {id(p): (b, k) for b, ps in enumerate(self._buckets) for k, p in enumerate(ps)}
        # a bucket of several dtypes reduces in their promoted one (fp32 beside bf16), never in
        # whichever dtype its first parameter has: an fp32 gradient rounded to bf16 lost 3 digits
        self._dtype = [comm_dtype or functools.reduce(torch.promote_types, [p.dtype for p in ps])
                       for ps in self._buckets]
        # exact buckets of one dtype reduce in a buffer kept across steps, and the gradients are
        # left as views of it (torch DDP's gradient_as_bucket_view): no copy back, no allocation
        self._as_view = [comm_quant is None and len({p.dtype for p in ps}) == 1 for ps in self._buckets]
        self._flat: list[torch.Tensor | None] = [None] * len(self._buckets)
        loco = error_feedback if isinstance(error_feedback, dict) else None
        self._feedback = [cq.ErrorFeedback.from_loco(loco) if error_feedback else None for _ in self._buckets]
        self._clear_used()
        self._arm()
        self._inflight: list = []
        self._queued = False
        self.require_sync = True
        self.reduced_during_backward = 0  # buckets whose all-reduce a gradient hook started (overlap)
        # world size 1, exact dtype, no codec: the average over one rank is the gradient itself
        self._alone = dist.get_world_size(group) == 1 and comm_quant is None and comm_dtype in (None, torch.float32)
        self.clock = StepClock(trace_sink())  # forward, then backward up to the end of the reduction
        # the hooks hold the wrapper weakly and go with it (as torch DDP's reducer's): bound to
        # it, they kept it alive and all-reduced every later backward of the bare module
        hook = functools.partial(_on_grad_of, weakref.ref(self))
        self._grad_hooks = [p.register_post_accumulate_grad_hook(hook) for p in self._params]
        weakref.finalize(self, _remove_all, self._grad_hooks)

    def _arm(self) -> None:
        """Before a backward (at forward, and after each reduction, so that a second backward of
        one forward is reduced too): every bucket waits for all its gradients, none started.
        The used-flags are not reset here but after each reduction (``_clear_used``): a
        parameter used only in ``no_sync`` micro-steps holds an accumulated gradient that the
        synchronised backward must reduce, as torch DDP counts usage across no_sync steps."""
        self._pending = [len(ps) for ps in self._buckets]
        self._next = 0  # the bucket whose all-reduce starts next: they start in index order

    def forward(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            # evaluation, perhaps on one rank only: no collective, as torch DDP (a buffer
            # broadcast here met the other ranks' next training forward, or waited out the deadline)
            return self.module(*args, **kwargs)
        if self.broadcast_buffers and self.require_sync:
            with torch.no_grad():
                for b in self.module.buffers():
                    dist.broadcast(b, self._src, self.group)
        if self._queued:  # the last backward raised: its end (_finish) never ran
            self._drop_unfinished()
        self._arm()
        self.clock.abandon()  # a backward that never reduced (no_sync, or none at all)
        with self.clock.span("forward"):
            out = self.module(*args, **kwargs)
        if self.require_sync:
            self.clock.enter("backward")  # left by _finish, at the end of the reduction
        return out

    def step_breakdown(self) -> StepBreakdown | None:
        """The last synchronised step's forward and backward (the optimizer step is the
        caller's, so ``optimizer`` is 0); None before the first."""
        return self.clock.last

    @contextlib.contextmanager
    def no_sync(self):
        """Gradients accumulate locally; the first backward after the block reduces the sum."""
        old, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = old

    def _on_grad(self, p: nn.Parameter) -> None:
        b, k = self._slot[id(p)]
        self._used[b][k] = True  # under no_sync too: its accumulated gradient is reduced later
        if not self.require_sync:
            return
        if not self._queued:  # wait for everything once backward has finished
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._queued = True
        self._pending[b] -= 1
        # in index order only, as torch DDP does: every rank's n-th all-reduce must be the same
        # bucket whatever order its hooks fired in (a parameter this rank's forward left out fills
        # its bucket only in _finish; a bucket of the same size started before it was averaged
        # with another rank's different bucket, without an error)
        while self._next < len(self._buckets) and self._pending[self._next] == 0:
            with self.clock.span("bookkeeping"):
                self._reduce(self._next)
            self.reduced_during_backward += 1

    def _reduce(self, b: int) -> None:
        params = self._buckets[b]
        self._pending[b], self._next = -1, b + 1  # reduced
        if self._alone and all(p.dtype == torch.float32 for p in params):
            return  # p.grad is already the average (a missing one stays None, as without DataParallel)
        dtype = self._dtype[b]
        if self._as_view[b] and dtype == params[0].dtype:
            flat = self._fill_bucket(b)
        else:
            parts = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(dtype) for p in params]
            if self.comm_quant is None:
                parts.append(torch.tensor(self._used[b], dtype=dtype))
            flat = torch.cat(parts)
        if self.comm_quant is not None:
            work = cq.all_reduce(flat, ReduceOp.AVG, self.group, True, quant=self.comm_quant,
                                 feedback=self._feedback[b])
        else:
            work = dist.all_reduce(flat, ReduceOp.AVG, self.group, async_op=True)
        self._inflight.append((work, b, flat))

    def _fill_bucket(self, b: int) -> torch.Tensor:
        """The bucket's gradients in its buffer, kept from step to step (a fresh one per step
        page-faulted its whole size every time), then one flag per parameter: whether this rank
        produced its gradient (``_finish_reductions``). A gradient that already is its view
        there (the last step's, accumulated in place) is not copied."""
        params, flat = self._buckets[b], self._flat[b]
        if flat is None:
            numel = sum(p.numel() for p in params)
            flat = self._flat[b] = torch.empty(numel + len(params), dtype=params[0].dtype)
        offset = 0
        for p in params:
            n = p.numel()
            dst = flat[offset:offset + n]
            if p.grad is None:
                dst.zero_()
            elif p.grad.data_ptr() != dst.data_ptr() or not p.grad.is_contiguous():
                dst.copy_(p.grad.reshape(-1))
            offset += n
        flat[offset:] = torch.tensor(self._used[b], dtype=flat.dtype)
        return flat

    def _finish(self) -> None:
        with self.clock.span("bookkeeping"):
            self._finish_reductions()
        if self.clock.open():
            self.clock.leave()  # the backward entered after forward
            self.clock.finish_step()

    def _finish_reductions(self) -> None:
        while self._next < len(self._buckets):  # parameters without a gradient: zeros, in order
            self._reduce(self._next)
        for work, b, flat in self._inflight:
            with self.clock.span("comm_waited"):
                work.wait()
            params = self._buckets[b]
            # a parameter no rank produced a gradient for (unused, or frozen after wrapping) keeps
            # its p.grad (None), as without DataParallel and with torch DDP; under comm_quant the
            # flags are not sent and every parameter gets the average (zeros where unused)
            used = flat[-len(params):].tolist() if self.comm_quant is None else [1] * len(params)
            offset = 0
            for p, u in zip(params, used):
                n = p.numel()
                g = flat[offset:offset + n].view(p.shape)
                offset += n
                if u == 0:
                    continue
                if flat is self._flat[b]:  # the gradient is a view of the bucket (no copy back)
                    p.grad = g
                elif p.grad is None:
                    p.grad = g.to(p.dtype)  # back to fp32 for accumulation
                else:
                    p.grad.copy_(g)
        self._inflight, self._queued = [], False
        self._clear_used()
        self._arm()  # a second backward of the same forward is reduced as the first

    def _drop_unfinished(self) -> None:
        """A backward that raised after its first gradient hook (an error in a later autograd
        node) leaves its end-of-backward callback unrun: ``_queued`` stayed set, so no later
        backward queued ``_finish`` again and no gradient was ever averaged from then on (each
        replica stepped on its own gradients, silently). Its reductions already started are
        waited for (every rank that raised alike issued them; the buckets are reused) and
        dropped with its used-flags: its gradients are the caller's to discard, as in torch.
        One that ended after the caller discarded them wrote into the bucket buffer their
        ``p.grad`` views (``zero_grad(set_to_none=False)`` zeroed it in place before): those
        gradients are let go of (None), or the next backward added the failed one's average."""
        inflight, self._inflight, self._queued = self._inflight, [], False
        for work, b, flat in inflight:
            work.wait()
            if flat is self._flat[b]:
                for p in self._buckets[b]:
                    if p.grad is not None and p.grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr():
                        p.grad = None
        self._clear_used()

    def _clear_used(self) -> None:
        """No parameter has produced a gradient since the last reduction (at construction and
        after each one: the flags span the no_sync micro-steps before a synchronised backward)."""
        self._used = [[False] * len(ps) for ps in self._buckets]


def _on_grad_of(ref: weakref.ref, p: nn.Parameter) -> None:
    """A parameter's gradient hook: its DataParallel's, while that still exists."""
    wrapper = ref()
    if wrapper is not None:
        wrapper._on_grad(p)


def _remove_all(handles: list) -> None:
    for h in handles:
        h.remove()
