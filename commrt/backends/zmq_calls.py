"""The zmq backend's collectives, their front half: each turns the caller's buffers into flat
ones (widened where a reduction would wrap), refuses bad input (told to the peers, see
``ZmqBackend._refused``) and hands the op's body to ``ZmqBackend._collective``, which numbers
it and runs it on the group's executor over TCP (collectives/ops.py) or shared memory
(collectives/shm_ops.py)."""
from __future__ import annotations

import numpy as np

from commrt.runtime import dtypes
from commrt.runtime.arrays import UINT8, numel
from commrt.collectives.context import Coll
from commrt.collectives.reduce_ops import ReduceOp, check_defined
from commrt.backends.base import (avg_as_is, check_same_dtype, flat_view, narrow_int, plain, same_kind,
                                  split_bounds, widened)

STAGE_PIECES = 4  # a staged all_reduce piece is this many pipelining chunks
AVG = ReduceOp.AVG  # a module constant: the enum's attribute costs more than the comparison


class CollectiveCalls:
    """Mixed into ZmqBackend (its ``rank``, ``size``, ``cfg``, ``_ops``, ``_collective`` and
    ``_refused``)."""

    def all_reduce(self, tensor, op=ReduceOp.SUM, async_op=False):
        flat = plain(tensor)  # the common case: nothing to check or widen
        if flat is not None and (op != AVG or avg_as_is(flat.dtype)):
            return self._collective(Coll.ALL_REDUCE, flat.dtype, numel(flat),
                                    lambda ctx: self._ops.all_reduce(ctx, flat, op), async_op, reduce=op,
                                    declared=flat.dtype)
        try:
            t = dtypes.as_buffer(tensor)
            check_defined(op, t.dtype, "all_reduce")
        except (ValueError, TypeError) as exc:
            raise self._refused(Coll.ALL_REDUCE, exc, async_op)
        # a CUDA tensor is staged through pinned memory in pieces; but an integer AVG goes the
        # flat way below (one host copy, then widened: its pieces' sums would wrap in int8)
        if not isinstance(t, np.ndarray) and t.is_cuda and not (op == ReduceOp.AVG and narrow_int(t)):
            from commrt.backends.staging import Staged  # lazy: torch's CUDA
            staged = Staged(t, STAGE_PIECES * self.cfg.comm.chunk_bytes)
            return self._collective(Coll.ALL_REDUCE, t.dtype, numel(t),
                                    lambda ctx: staged.run(lambda piece: self._ops.all_reduce(ctx, piece, op)),
                                    async_op, reduce=op)
        try:
            flat, wb = flat_view(tensor)
            declared = flat.dtype
            flat, wb = widened(flat, op, wb)
        except (ValueError, TypeError) as exc:
            raise self._refused(Coll.ALL_REDUCE, exc, async_op)
        return self._collective(Coll.ALL_REDUCE, flat.dtype, numel(flat),
                                lambda ctx: self._ops.all_reduce(ctx, flat, op), async_op, wb, reduce=op,
                                declared=declared)

    def _whole_and_part(self, output, input, name: str, whole: str):
        """(out, write-back, inp), flat, of an op whose ``whole`` ("input" or "output") holds
        world-size parts the size of the other."""
        out, inp = same_kind(dtypes.as_buffer(output), dtypes.as_buffer(input, writes=False))
        out, wb = flat_view(out, "output")
        inp, _ = flat_view(inp, "input", writes=False)
        check_same_dtype(out, inp, name)
        big, small, part = (inp, out, "output") if whole == "input" else (out, inp, "input")
        if numel(big) != numel(small) * self.size:
            raise ValueError(f"{name}: {whole} has {numel(big)} elements, expected "
                             f"{part} ({numel(small)}) x world size ({self.size})")
        return out, wb, inp

    def _plain_pair(self, output, input, whole: str):
        """(out, inp) flat as given (``plain``), of one kind and dtype, ``whole`` ("input" or
        "output") world-size times the other; None where anything needs the general path."""
        out, inp = plain(output), plain(input)
        if out is None or inp is None or type(out) is not type(inp) or out.dtype != inp.dtype:
            return None
        big, small = (inp, out) if whole == "input" else (out, inp)
        return (out, inp) if numel(big) == numel(small) * self.size else None

    def reduce_scatter_tensor(self, output, input, op=ReduceOp.SUM, async_op=False):
        pair = self._plain_pair(output, input, "input")
        if pair is not None and (op != AVG or avg_as_is(pair[0].dtype)):  # the common case, as all_reduce's
            out, inp = pair
            return self._collective(Coll.REDUCE_SCATTER, out.dtype, numel(inp),
                                    lambda ctx: self._ops.reduce_scatter(ctx, out, inp, op), async_op, reduce=op,
                                    declared=out.dtype)
        try:
            out, wb, inp = self._whole_and_part(output, input, "reduce_scatter_tensor", "input")
            check_defined(op, out.dtype, "reduce_scatter_tensor")
            declared = out.dtype
            out, wb = widened(out, op, wb, fresh=True)
            inp, _ = widened(inp, op, None)
        except (ValueError, TypeError) as exc:
            raise self._refused(Coll.REDUCE_SCATTER, exc, async_op)
        return self._collective(Coll.REDUCE_SCATTER, out.dtype, numel(inp),
                                lambda ctx: self._ops.reduce_scatter(ctx, out, inp, op), async_op, wb, reduce=op,
                                declared=declared)

    def all_gather_into_tensor(self, output, input, async_op=False):
        pair = self._plain_pair(output, input, "output")
        if pair is not None:
            out, inp = pair
            return self._collective(Coll.ALL_GATHER, out.dtype, numel(out),
                                    lambda ctx: self._ops.all_gather(ctx, out, inp), async_op)
        try:
            out, wb, inp = self._whole_and_part(output, input, "all_gather_into_tensor", "output")
        except (ValueError, TypeError) as exc:
            raise self._refused(Coll.ALL_GATHER, exc, async_op)
        return self._collective(Coll.ALL_GATHER, out.dtype, numel(out),
                                lambda ctx: self._ops.all_gather(ctx, out, inp), async_op, wb)

    def broadcast(self, tensor, src, async_op=False):
        flat = plain(tensor)
        if flat is not None:
            return self._collective(Coll.BROADCAST, flat.dtype, numel(flat),
                                    lambda ctx: self._ops.broadcast(ctx, flat, src), async_op, root=src)
        # the source only reads its buffer: a read-only one is fine there (nothing to store back)
        try:
            flat, wb = flat_view(tensor, writes=self.rank != src)
        except (ValueError, TypeError) as exc:
            raise self._refused(Coll.BROADCAST, exc, async_op)
        wb = wb if self.rank != src else None
        return self._collective(Coll.BROADCAST, flat.dtype, numel(flat),
                                lambda ctx: self._ops.broadcast(ctx, flat, src), async_op, wb, root=src)

    def reduce(self, tensor, dst, op=ReduceOp.SUM, async_op=False):
        # the others' buffers are inputs only (a read-only one too): nothing to store back
        try:
            flat, wb = flat_view(tensor, writes=self.rank == dst)
            check_defined(op, flat.dtype, "reduce")
            declared = flat.dtype
            flat, wb = widened(flat, op, wb) if self.rank == dst else (widened(flat, op, None)[0], None)
        except (ValueError, TypeError) as exc:
            raise self._refused(Coll.REDUCE, exc, async_op)
        return self._collective(Coll.REDUCE, flat.dtype, numel(flat),
                                lambda ctx: self._ops.reduce(ctx, flat, dst, op), async_op, wb, reduce=op,
                                root=dst, declared=declared)

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None,
                          async_op=False):
        try:
            o, i = same_kind(dtypes.as_buffer(output), dtypes.as_buffer(input, writes=False))
            out, wb = flat_view(o, "output")
            inp, _ = flat_view(i, "input", writes=False)
            check_same_dtype(out, inp, "all_to_all_single")
            out_b = split_bounds(numel(out), o.shape[0] if o.ndim else 1, output_split_sizes, self.size, "output")
            in_b = split_bounds(numel(inp), i.shape[0] if i.ndim else 1, input_split_sizes, self.size, "input")
            (lo, hi), (olo, ohi) = in_b[self.rank], out_b[self.rank]
            if hi - lo != ohi - olo:  # the block a rank sends itself: checked here, where it is known
                raise ValueError(f"all_to_all_single: rank {self.rank} sends itself {hi - lo} elements but "
                                 f"expects {ohi - olo} from itself (input and output split sizes at {self.rank})")
        except (ValueError, TypeError) as exc:
            raise self._refused(Coll.ALL_TO_ALL, exc, async_op)
        return self._collective(Coll.ALL_TO_ALL, out.dtype, 0,
                                lambda ctx: self._ops.all_to_all(ctx, out, inp, out_b, in_b), async_op, wb,
                                nbytes=max(numel(inp), numel(out)) * out.dtype.itemsize)

    def barrier(self, async_op=False):
        return self._collective(Coll.BARRIER, UINT8, 0, lambda ctx: self._ops.barrier(ctx), async_op)
