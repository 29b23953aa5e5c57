"""Which memory an operation's output may share with its input: the rules of every collective,
decided here once for both paths (issues 12.1 and 28.3; a wrong in-place reduce_scatter once
lived in one of two copies of these rules).

The in-place forms NCCL documents run without a copy: reduce_scatter's output is the input's
own slice, all_gather's input is the output's own slice. Any other overlap, and all_to_all with
output and input one tensor, costs one copy, so every form is correct. Overlap is decided by
address ranges (``dtypes.overlaps``), never by object identity, which a view never passes.
``Aliased`` applies the rules in front of an ``Algorithms`` (ops.py or shm_ops.py), which may
then assume an output disjoint from its input or in the in-place form.
"""
from __future__ import annotations

from commrt.runtime.arrays import address, clone, empty_like, numel
from commrt.runtime.dtypes import overlaps
from commrt.collectives.contract import Algorithms
from commrt.collectives.reduce_ops import ReduceOp, copy_


def reduce_scatter_in_place(out, inp, rank: int) -> bool:
    """Whether ``out`` is ``inp``'s own slice for ``rank`` (NCCL's in-place form)."""
    m = numel(out)
    return m > 0 and address(out) == address(inp[rank * m:])


def all_gather_in_place(out, inp, rank: int) -> bool:
    """Whether ``inp`` is ``out``'s own slice for ``rank`` (NCCL's in-place form)."""
    m = numel(inp)
    return m > 0 and address(out[rank * m:]) == address(inp)


def reduce_scatter_needs_temporary(out, inp, rank: int) -> bool:
    """An overlap other than the in-place form: a write to ``out`` could clobber input that a
    later step still reads, so the result goes to a temporary first."""
    return numel(out) > 0 and overlaps(out, inp) and not reduce_scatter_in_place(out, inp, rank)


def all_gather_source(out, inp, rank: int):
    """The input to gather from: ``inp`` itself, or a copy when received blocks could clobber it."""
    if numel(inp) and overlaps(out, inp) and not all_gather_in_place(out, inp, rank):
        return clone(inp)
    return inp


def all_to_all_source(out, inp):
    """The input to send from: a copy when it shares memory with ``out`` (received blocks
    would overwrite blocks not sent yet)."""
    return clone(inp) if numel(out) and overlaps(out, inp) else inp


def own_part(own, out, position: int):
    """This rank's part of a rank-ordered reduction into ``out`` (reduce_ops.reduce_in_order_):
    it may be ``out`` itself only as the first or second part, read before ``out`` is written;
    at any later position, or overlapping otherwise, it is copied first."""
    same = address(own) == address(out) and numel(own) == numel(out)
    if (position > 1 or not same) and overlaps(own, out):
        return clone(own)
    return own


class Aliased:
    """``algorithms`` behind the aliasing rules: what the backend runs, on either path."""

    def __init__(self, algorithms: Algorithms):
        self.algorithms = algorithms

    # in place by nature: nothing to decide (looked up per call, so a test may patch the module)
    def all_reduce(self, ctx, flat, op: ReduceOp) -> None:
        self.algorithms.all_reduce(ctx, flat, op)

    def broadcast(self, ctx, flat, src: int) -> None:
        self.algorithms.broadcast(ctx, flat, src)

    def reduce(self, ctx, flat, dst: int, op: ReduceOp) -> None:
        self.algorithms.reduce(ctx, flat, dst, op)

    def barrier(self, ctx) -> None:
        self.algorithms.barrier(ctx)

    def reduce_scatter(self, ctx, out, inp, op: ReduceOp) -> None:
        if reduce_scatter_needs_temporary(out, inp, ctx.rank):
            tmp = empty_like(out)
            self.algorithms.reduce_scatter(ctx, tmp, inp, op)
            copy_(out, tmp)
        else:
            self.algorithms.reduce_scatter(ctx, out, inp, op)

    def all_gather(self, ctx, out, inp) -> None:
        self.algorithms.all_gather(ctx, out, all_gather_source(out, inp, ctx.rank))

    def all_to_all(self, ctx, out, inp, out_bounds, in_bounds) -> None:
        self.algorithms.all_to_all(ctx, out, all_to_all_source(out, inp), out_bounds, in_bounds)
