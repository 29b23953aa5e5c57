"""PipeDream: asynchronous 1F1B with no flush between batches, and weight stashing.

Update semantics are PipeDream-2BW's (Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN
Training", 2021): every stage updates once per batch of ``num_microbatches``, and batch b's
forwards *and* backwards all use weight version ``max(0, b - k)``, so
``W(b+1) = W(b) - lr * grad_b(W(b - k))`` on every stage alike. k = 1 (2BW's one-step staleness,
two weight versions kept) when ``num_microbatches >= num_stages - 1``; fewer micro-batches than
that need ``k = ceil((num_stages - 1) / num_microbatches)`` versions back, because the first stage
starts batch b before batch b - 1's gradients have come back.

Weight stashing: the version a micro-batch's forward used is kept until its backward has run, so
the gradient is the one of the function that was actually computed. With ``stash_weights=False``
(the naive alternative, for comparison) the backward recomputes the forward with whatever
weights are newest when it runs.
"""
from __future__ import annotations

import math

import torch
from torch.func import functional_call

from commrt.runtime.errors import ConfigError
from commrt.pipeline import data_parallel
from commrt.pipeline import schedules as S
from commrt.pipeline.runtime import PipelineSchedule, _Slot
from commrt.pipeline.stage import PipelineStage


class PipeDream(PipelineSchedule):
    """One ``step()`` trains ``num_batches`` batches (its inputs are their rows, concatenated) with
    SGD at ``lr``, the pipeline never draining between them; parameters of ``stage.module`` hold
    the newest version afterwards."""

    def __init__(self, stage: PipelineStage, num_microbatches: int, loss_fn=None, lr: float = 0.01,
                 num_batches: int = 1, stash_weights: bool = True, manual_gc_interval: int = 0):
        if num_batches < 1:
            raise ConfigError(f"PipeDream: num_batches must be >= 1, got {num_batches}")
        if data_parallel.replicated(stage.module):
            # its backwards run on stashed copies of the weights, which a wrapper's hooks never see
            raise ConfigError("PipeDream does not take a DataParallel or engine-wrapped stage (its weight "
                              "versions bypass the wrapper's gradient hooks); use GPipe, OneFOneB or Interleaved1F1B")
        self._batches = num_batches
        self._copy_inputs = not stash_weights  # its backward may recompute the forward on them
        self.micro, self.num_batches, self.lr, self.stash = num_microbatches, num_batches, lr, stash_weights
        self.staleness = max(1, math.ceil((stage.num_stages - 1) / num_microbatches))
        super().__init__([stage], num_microbatches * num_batches, loss_fn,
                         S.pipedream_actions(stage.num_stages, num_microbatches, num_batches), manual_gc_interval)
        self.module = stage.module
        self.names = [n for n, p in self.module.named_parameters() if p.requires_grad]
        self.versions_kept = 0  # most weight versions held at once, over the last step()

    def step(self, *args, target=None, losses=None):
        params = dict(self.module.named_parameters())
        self._versions = {0: [params[n].detach().clone().requires_grad_() for n in self.names]}
        self._latest = 0
        self._acc = {}
        self.versions_kept = 1
        out = super().step(*args, target=target, losses=losses)
        with torch.no_grad():
            for n, w in zip(self.names, self._versions[self._latest]):
                params[n].copy_(w)
        return out

    def _chunks(self, tensors, stage: int, what: str):
        if stage in self.stages and tensors and tensors[0].dim() and tensors[0].shape[0] % self.num_batches:
            raise ConfigError(f"PipeDream: {what} has {tensors[0].shape[0]} rows, not {self.num_batches} "
                              f"equal batches")
        return super()._chunks(tensors, stage, what)

    def _loss_scale(self, target: torch.Tensor) -> float:
        return target.shape[0] * self.num_batches / self._rows

    def _version_for(self, mb: int) -> int:
        return self._latest if not self.stash else max(0, mb // self.micro - self.staleness)

    def _call(self, stage: int, mb: int, slot: _Slot):
        v = self._version_for(mb)
        if v not in self._versions:
            raise AssertionError(f"version {v} of stage {stage} was freed before micro-batch {mb} ran")
        slot.extra["version"] = v
        return functional_call(self.module, dict(zip(self.names, self._versions[v])), tuple(slot.inputs))

    def _backward(self, stage: int, mb: int) -> None:
        slot = self._slots[(stage, mb)]
        if not self.stash and slot.extra["version"] != self._latest:
            # no stashing: the old weights are gone, so recompute the forward with the newest ones
            saved = self._outs.get(mb)
            self._forward(stage, mb)
            if saved is not None:
                self._outs[mb] = saved
        version = self._versions[slot.extra["version"]]
        super()._backward(stage, mb)
        acc = self._acc.setdefault(mb // self.micro, [torch.zeros_like(w) for w in version])
        for a, w in zip(acc, version):
            if w.grad is not None:
                a += w.grad
                w.grad = None

    def _other(self, a: S.Action) -> None:
        if a.kind != S.UPDATE:
            super()._other(a)
        grads = self._acc.pop(a.mb, None) or [torch.zeros_like(w) for w in self._versions[self._latest]]
        with torch.no_grad():
            new = [(w - self.lr * g).requires_grad_() for w, g in zip(self._versions[self._latest], grads)]
        self._latest += 1
        self._versions[self._latest] = new
        self.versions_kept = max(self.versions_kept, len(self._versions))
        oldest_needed = min(self._latest, max(0, a.mb + 1 - self.staleness)) if self.stash else self._latest
        for v in [v for v in self._versions if v < oldest_needed]:
            del self._versions[v]
