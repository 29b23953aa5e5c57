"""``DataParallel``: torch DDP's contract over commrt collectives, for users who keep their own
optimizer.

Gradients are copied into buckets (parameters in reverse registration order, about the order
backward produces them; the first bucket at most 1 MiB, as torch DDP's) and each bucket's all-reduce starts from the gradient hooks as soon as
it is full, so communication overlaps the rest of backward. At the end of backward (an autograd
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

import torch
from torch import nn

from commrt import distributed as dist
from commrt import quant as cq
from commrt.collectives.reduce_ops import ReduceOp
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
        self._bucket_of = {id(p): b for b, ps in enumerate(self._buckets) for p in ps}
        # exact buckets of one dtype reduce in a buffer kept across steps, and the gradients are
        # left as views of it (torch DDP's gradient_as_bucket_view): no copy back, no allocation
        self._as_view = [comm_quant is None and len({p.dtype for p in ps}) == 1 for ps in self._buckets]
        self._flat: list[torch.Tensor | None] = [None] * len(self._buckets)
        loco = error_feedback if isinstance(error_feedback, dict) else None
        self._feedback = [cq.ErrorFeedback.from_loco(loco) if error_feedback else None for _ in self._buckets]
        self._pending: list[int] = []
        self._inflight: list = []
        self._queued = False
        self.require_sync = True
        self.reduced_during_backward = 0  # buckets whose all-reduce a gradient hook started (overlap)
        # world size 1, exact dtype, no codec: the average over one rank is the gradient itself
        self._alone = dist.get_world_size(group) == 1 and comm_quant is None and comm_dtype in (None, torch.float32)
        self.clock = StepClock(trace_sink())  # forward, then backward up to the end of the reduction
        for p in self._params:
            p.register_post_accumulate_grad_hook(self._on_grad)

    def forward(self, *args, **kwargs):
        if self.broadcast_buffers and self.require_sync:
            with torch.no_grad():
                for b in self.module.buffers():
                    dist.broadcast(b, self._src, self.group)
        self._pending = [len(ps) for ps in self._buckets]
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
        if not self.require_sync:
            return
        if not self._queued:  # wait for everything once backward has finished
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._queued = True
        b = self._bucket_of[id(p)]
        self._pending[b] -= 1
        if self._pending[b] == 0:
            with self.clock.span("bookkeeping"):
                self._reduce(b)
            self.reduced_during_backward += 1

    def _reduce(self, b: int) -> None:
        params = self._buckets[b]
        if self._alone and all(p.dtype == torch.float32 for p in params):
            self._pending[b] = -1  # p.grad is already the average; a missing one becomes zeros
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            return
        dtype = self.comm_dtype or params[0].dtype
        if self._as_view[b] and dtype == params[0].dtype:
            flat = self._fill_bucket(b)
        else:
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(dtype)
                              for p in params])
        self._pending[b] = -1  # reduced
        if self.comm_quant is not None:
            work = cq.all_reduce(flat, ReduceOp.AVG, self.group, True, quant=self.comm_quant,
                                 feedback=self._feedback[b])
        else:
            work = dist.all_reduce(flat, ReduceOp.AVG, self.group, async_op=True)
        self._inflight.append((work, b, flat))

    def _fill_bucket(self, b: int) -> torch.Tensor:
        """The bucket's gradients in its buffer, kept from step to step (a fresh one per step
        page-faulted its whole size every time); a gradient that already is its view there
        (the last step's, accumulated in place) is not copied."""
        flat = self._flat[b]
        if flat is None:
            flat = self._flat[b] = torch.empty(sum(p.numel() for p in self._buckets[b]), dtype=self._buckets[b][0].dtype)
        offset = 0
        for p in self._buckets[b]:
            n = p.numel()
            dst = flat[offset:offset + n]
            if p.grad is None:
                dst.zero_()
            elif p.grad.data_ptr() != dst.data_ptr() or not p.grad.is_contiguous():
                dst.copy_(p.grad.reshape(-1))
            offset += n
        return flat

    def _finish(self) -> None:
        with self.clock.span("bookkeeping"):
            self._finish_reductions()
        if self.clock.open():
            self.clock.leave()  # the backward entered after forward
            self.clock.finish_step()

    def _finish_reductions(self) -> None:
        for b, left in enumerate(self._pending):
            if left > 0:  # some parameters got no gradient this time: reduce zeros for them
                self._reduce(b)
        for work, b, flat in self._inflight:
            with self.clock.span("comm_waited"):
                work.wait()
            offset = 0
            for p in self._buckets[b]:
                n = p.numel()
                g = flat[offset:offset + n].view(p.shape)
                if flat is self._flat[b]:  # the gradient is a view of the bucket (no copy back)
                    p.grad = g
                elif p.grad is None:
                    p.grad = g.to(p.dtype)  # back to fp32 for accumulation
                else:
                    p.grad.copy_(g)
                offset += n
        self._inflight, self._queued = [], False
