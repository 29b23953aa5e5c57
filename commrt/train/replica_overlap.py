"""Replica fault tolerance, a replica that is one rank (data parallel): its gradients, and the
healthy step's all-reduce overlapped with backward (issue 33 item 5, the <= 3% overhead): as
DataParallel does, gradients go into buckets (reverse registration order, the first one small)
from the gradient hooks, and each bucket's all-reduce starts as soon as it and every bucket
before it are full (one order on every replica). Unlike
DataParallel, the buckets are *copies*: ``p.grad`` keeps this replica's own gradient until the
step commits, so a step that fails is redone from it.

All buckets are slices of one flat buffer kept across steps (a fresh one per step page-faulted
its whole size every time); the plain path (``Replicated.flat``) fills the same buffer in the
same order, so ``apply`` reads either alike. A failure in a hook is not raised there (backward would be left half done):
it is kept and reported by ``finish``. ``ReplicaFT`` arms the buckets only when the next
backward belongs to a healthy generation; a redo, or a step whose backward ran before the
generation was armed, takes the plain path (copy, then one all-reduce).
"""
from __future__ import annotations

import functools

import torch

from commrt.collectives.reduce_ops import ReduceOp
from commrt.runtime.errors import CommError, ConfigError
from commrt.train.layout import buckets

CAP_ELEMS, FIRST_ELEMS = (25 << 20) // 4, (1 << 20) // 4  # torch DDP's 25 MiB buckets, 1 MiB first


def flat_dtype(params: list[torch.nn.Parameter]) -> torch.dtype:
    """The dtype the gradients are averaged in: float32, or wider if a parameter is (a bf16
    gradient is summed in float32, fewer roundings; ``grad_of`` gives each parameter its own
    dtype back)."""
    return functools.reduce(torch.promote_types, (p.dtype for p in params), torch.float32)


def grad_of(p: torch.nn.Parameter, view: torch.Tensor) -> torch.Tensor:
    """The averaged gradient as ``p.grad`` (which must have ``p``'s dtype): the view, or a copy."""
    return view if view.dtype == p.dtype else view.to(p.dtype)


class Overlap:
    def __init__(self, params: list[torch.nn.Parameter], timeout_s: float):
        self.params, self.timeout_s = params, timeout_s
        units = buckets([p.numel() for p in params], CAP_ELEMS, 1, FIRST_ELEMS)
        self.order = [params[i] for u in units for i in u.params]  # the flat buffer's order
        self.offset, self.bucket_of, self.spans, self.members, off = {}, {}, [], [], 0
        for b, u in enumerate(units):
            start = off
            self.members.append([params[i] for i in u.params])
            for i in u.params:
                self.offset[id(params[i])] = off
                self.bucket_of[id(params[i])] = b
                off += params[i].numel()
            self.spans.append((start, off, len(u.params)))
        self.flat = torch.zeros(off, dtype=flat_dtype(params))
        self.backend = None  # armed: the generation's backend
        self._pending: list[int] = []
        self._next = 0  # the bucket whose all-reduce starts next (they start in index order)
        self._seen: set[int] = set()  # parameters whose gradient hook fired since arm
        self._twice: str | None = None  # a parameter's second gradient in one step (two backwards)
        self._works: list = []
        self._error: CommError | None = None
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_grad)

    def arm(self, backend) -> None:
        self.backend, self._works, self._error, self._next = backend, [], None, 0
        self._seen, self._twice = set(), None
        self._pending = [n for _, _, n in self.spans]

    def disarm(self) -> None:
        self.backend = None

    @property
    def started(self) -> bool:
        return self.backend is not None and any(left < n for left, (_, _, n) in zip(self._pending, self.spans))

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        if self.backend is None or id(p) not in self.bucket_of:
            return
        if id(p) in self._seen:  # its bucket may have gone out with the first backward's part only
            self._twice = self._twice or f"a parameter of shape {tuple(p.shape)}"
            return
        self._seen.add(id(p))
        self._pending[self.bucket_of[id(p)]] -= 1
        # in index order only, as torch DDP does: every replica's n-th all-reduce must be the same
        # bucket whatever order its hooks fired in (a parameter a replica's forward left out fills
        # its bucket only in finish; a bucket of the same size started before it would be summed
        # with another replica's different bucket, without an error)
        while self._next < len(self.spans) and self._pending[self._next] == 0:
            self._start(self._next)

    def _start(self, b: int) -> None:
        lo, hi, _ = self.spans[b]
        self._pending[b], self._next = -1, b + 1
        self._copy(self.members[b])
        if self._error is not None:
            return
        try:
            self._works.append(self.backend.all_reduce(self.flat[lo:hi], ReduceOp.SUM, True))
        except CommError as exc:
            self._error = exc

    def finish(self) -> CommError | None:
        """After backward: start the buckets no hook completed (parameters without a gradient),
        wait for every all-reduce; the first failure, or None. Disarms. ``ConfigError`` when a
        step ran more than one backward: the all-reduces may have carried the first one's part."""
        if self._twice is not None:
            self.backend = None
            raise ConfigError(f"replica fault tolerance with overlap=True: {self._twice} got a second gradient in "
                              "one step (more than one backward before step()); its bucket may have been averaged "
                              "without it. Accumulate gradients with ReplicaFT(overlap=False)")
        while self._next < len(self.spans):
            self._start(self._next)
        for work in self._works:
            try:
                work.wait(self.timeout_s)
            except CommError as exc:
                self._error = self._error or exc
        self.backend = None
        return self._error

    def fill(self, mine: bool) -> torch.Tensor:
        """The plain path: this replica's gradients (or zeros) into the flat buffer, in its order."""
        if not mine:
            return self.flat.zero_()
        self._copy(self.order)
        return self.flat

    def _copy(self, params) -> None:
        for p in params:
            dst = self.flat[self.offset[id(p)]:self.offset[id(p)] + p.numel()]
            if p.grad is None:
                dst.zero_()
            else:
                dst.copy_(p.grad.reshape(-1))

    def views(self) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        return [(p, self.flat[self.offset[id(p)]:self.offset[id(p)] + p.numel()].view_as(p)) for p in self.params]


class Replicated:
    """The gradients of a replica that is one rank, behind the interface ``ReplicaFT`` also uses
    for a group (replica_group.ShardedGroup): ``prepare`` after backward, ``overlapped`` /
    ``finish`` when the buckets went out during backward, else ``flat`` (a copy to all-reduce),
    then ``apply`` with the sum and the divisor."""

    def __init__(self, params: list[torch.nn.Parameter], optimizer, overlap: bool, timeout_s: float):
        self.params, self.optimizer = params, optimizer
        self.overlap = Overlap(params, timeout_s) if overlap else None

    def prepare(self) -> None:
        pass

    def arm(self, backend) -> None:
        if self.overlap is not None:
            self.overlap.arm(backend)

    def overlapped(self) -> bool:
        return self.overlap is not None and self.overlap.started

    def finish(self) -> tuple[torch.Tensor, CommError | None]:
        return self.overlap.flat, self.overlap.finish()

    def flat(self, mine: bool) -> torch.Tensor:
        """A copy of this replica's gradients (zeros if it has none for this step): the
        all-reduce works on the copy, so ``p.grad`` keeps them for a redo."""
        if self.overlap is not None:
            self.overlap.disarm()
            return self.overlap.fill(mine)
        dtype = flat_dtype(self.params)
        if not mine:
            return torch.zeros(sum(p.numel() for p in self.params), dtype=dtype)
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(dtype)
                          for p in self.params])

    def apply(self, flat: torch.Tensor, divisor: int) -> None:
        flat.div_(divisor)
        if self.overlap is not None:  # the buffer's order is the buckets'
            for p, view in self.overlap.views():
                p.grad = grad_of(p, view)
        else:
            offset = 0
            for p in self.params:
                p.grad = grad_of(p, flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
