"""Element-wise kernels for the collectives (reduce, copy, average), in place, plus ReduceOp.

AVG: float32, float64 and the integers sum and then divide by n (integers floor); float16 and
bfloat16 divide each rank's contribution by n first and then sum (``avg_part``), as NCCL's
PreMulSum does for AVG: the sum of n float16 values near 65504 overflows to inf although their
mean fits. Each rank divides its own part before it leaves, so every rank still reduces the same
bytes in the same order and gets the same bits, on either path.

They run through numpy, not torch: torch parallelises element-wise ops above 32768 elements
with OpenMP, and with several ranks per host the spinning thread pools starve each other
(measured: a 512 KiB all_reduce went from 0.6 ms to 14 ms at n=2 on 2 cores). numpy is
single-threaded and releases the GIL, so ZeroMQ's I/O thread keeps moving bytes meanwhile.
numpy has no bfloat16, so bfloat16 uses torch in blocks below the parallel grain size.
Buffers are numpy arrays or torch tensors (runtime/arrays.py); torch is never imported here:
a tensor's presence means it is loaded (a numpy-only rank runs without it, issue 32.2).
"""
from __future__ import annotations

import enum
import sys

import numpy as np

from commrt.runtime.arrays import as_bytes, clone, numel
from commrt.runtime.dtypes import NUMPY, dtype_name

_GRAIN = 16384  # elements per torch call for bfloat16: below at::internal::GRAIN_SIZE
_DIVIDED_FIRST = frozenset({"float16", "bfloat16"})  # AVG divides the parts, not the sum


class ReduceOp(enum.IntEnum):
    """Same names as ``torch.distributed.ReduceOp``; values are our wire codes."""
    SUM = 0
    AVG = 1
    PRODUCT = 2
    MIN = 3
    MAX = 4


_UFUNC = {ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.PRODUCT: np.multiply,
          ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum}
_TORCH = {ReduceOp.SUM: "add", ReduceOp.AVG: "add", ReduceOp.PRODUCT: "mul", ReduceOp.MIN: "minimum",
          ReduceOp.MAX: "maximum"}


def _bf16(t) -> bool:
    """A bfloat16 tensor: no numpy type, so torch does its arithmetic."""
    return not isinstance(t, np.ndarray) and t.dtype == sys.modules["torch"].bfloat16


def _np(x) -> np.ndarray:
    return x if isinstance(x, np.ndarray) else x.numpy()


# torch's reduce ops that ours are not, and what to do instead
_NOT_OURS = {"PREMUL_SUM": "scale the tensor and use SUM (what NCCL's premul sum does)",
             "BAND": "bitwise: all_gather and fold locally (the torch.distributed backend does)",
             "BOR": "bitwise: all_gather and fold locally (the torch.distributed backend does)",
             "BXOR": "bitwise: all_gather and fold locally (the torch.distributed backend does)"}


def parse_op(name) -> ReduceOp:
    if isinstance(name, ReduceOp):
        return name
    key = str(name).upper()
    key = {"PROD": "PRODUCT", "MEAN": "AVG"}.get(key, key)
    if key in _NOT_OURS:
        raise ValueError(f"reduce op {key} is not supported; {_NOT_OURS[key]}; valid: {list(ReduceOp.__members__)}")
    if key not in ReduceOp.__members__:
        raise ValueError(f"unknown reduce op '{name}'; valid: {list(ReduceOp.__members__)}")
    return ReduceOp[key]


def as_op(op) -> ReduceOp:
    """Any spelling users pass (``ReduceOp``, a name, torch's ``ReduceOp.SUM``) as ours."""
    if type(op) is ReduceOp:  # the common case, on every reducing call
        return op
    if isinstance(op, (ReduceOp, str)):
        return parse_op(op)
    # torch's: a RedOpType, or a ReduceOp object holding one in ``op`` (a premul sum's)
    return parse_op(str(getattr(op, "op", op)).rsplit(".", 1)[-1])


def check_defined(op: ReduceOp, dtype, what: str) -> None:
    """Refuse a reduction ``dtype`` does not define, before anything is sent (every rank alike).
    bool's are numpy's ufuncs on bool, as torch, gloo and NCCL define them: SUM and MAX a logical
    or, PRODUCT and MIN a logical and (never wrapping); an average of truth values has no meaning."""
    if op == ReduceOp.AVG and dtype_name(dtype) == "bool":
        raise ValueError(f"{what}: AVG is not defined for bool tensors; valid: SUM/MAX (logical or), "
                         "PRODUCT/MIN (logical and)")


def combine_into(out, a, b, op: ReduceOp) -> None:
    """out = a (op) b, element-wise; ``out`` may be ``a``. AVG accumulates as SUM."""
    if isinstance(out, np.ndarray):
        _UFUNC[op](_np(a), _np(b), out=out)
    elif _bf16(out):
        fn = getattr(sys.modules["torch"], _TORCH[op])
        for s in range(0, out.numel(), _GRAIN):
            fn(a[s:s + _GRAIN], b[s:s + _GRAIN], out=out[s:s + _GRAIN])
    else:
        _UFUNC[op](_np(a), _np(b), out=out.numpy())


def combine_(acc, other, op: ReduceOp) -> None:
    """acc = acc (op) other, in place."""
    combine_into(acc, acc, other, op)


def reduce_in_order_(out, parts: list, op: ReduceOp) -> None:
    """out = parts[0] (op) parts[1] (op) ... left to right, so that every rank, running this on
    the same parts, gets bit-identical results. A part is a tensor or a received frame's bytes
    (same dtype as ``out``); ``out`` may be parts[0] or parts[1] but no later part. AVG sums."""
    if _bf16(out):  # no numpy type: torch, in blocks (see combine_into)
        torch = sys.modules["torch"]
        ts = [p if isinstance(p, torch.Tensor) else torch.frombuffer(p, dtype=out.dtype) for p in parts]
        combine_into(out, ts[0], ts[1], op)
        for t in ts[2:]:
            combine_(out, t, op)
        return
    o = _np(out)
    reduce_arrays_(o, [p if isinstance(p, np.ndarray) else np.frombuffer(p, dtype=o.dtype)
                       if isinstance(p, (bytes, bytearray, memoryview)) else p.numpy() for p in parts], op)


def reduce_arrays_(out: np.ndarray, parts: list[np.ndarray], op: ReduceOp) -> None:
    """reduce_in_order_ on numpy arrays of ``out``'s dtype (the one place the order is fixed)."""
    fn = _UFUNC[op]
    fn(parts[0], parts[1], out=out)
    for a in parts[2:]:
        fn(out, a, out=out)


def reduce_rows_(out: np.ndarray, rows: np.ndarray, op: ReduceOp) -> None:
    """reduce_arrays_ over the rows of one 2-D array, in one call. numpy reduces axis 0 row
    after row, each element on its own, as reduce_arrays_ does, so the result is the same bit
    for bit; but a single column would make the row loop the inner one, which sums floats
    pairwise: callers pass at least two columns (tests/unit/test_reduce_rows.py)."""
    _UFUNC[op].reduce(rows, axis=0, out=out)


def numpy_dtype(dtype) -> np.dtype | None:
    """numpy's type for a torch or numpy dtype, or None where numpy has none (bfloat16)."""
    return dtype if isinstance(dtype, np.dtype) else NUMPY.get(dtype_name(dtype))


def copy_(dst, src) -> None:
    """dst[:] = src for flat buffers of one dtype (a byte copy, single-threaded)."""
    if numel(dst):
        np.copyto(as_bytes(dst), as_bytes(src))


def divides_first(dtype) -> bool:
    """Whether an AVG of ``dtype`` divides each rank's part before the sum (float16, bfloat16)
    rather than the sum (every other dtype: float32's results stay what they were)."""
    return dtype_name(dtype) in _DIVIDED_FIRST


def avg_part(t, op: ReduceOp, world_size: int, copy: bool = False):
    """What this rank contributes to a reduction: ``t`` itself, or for an AVG of a half type
    ``t / world_size``, in place (``copy``: in a new buffer, ``t`` left as it was)."""
    if op != ReduceOp.AVG or world_size == 1 or not divides_first(t.dtype):
        return t
    part = clone(t) if copy else t
    _divide_(part, world_size)
    return part


def _divide_(t, n: int) -> None:
    """t /= n for a floating-point buffer, on its own device."""
    if isinstance(t, np.ndarray):
        np.divide(t, n, out=t)
    elif t.device.type != "cpu":  # CUDA (the NCCL adapter): on the device, in stream order
        t.div_(n)
    elif t.dtype == sys.modules["torch"].bfloat16:  # no numpy type: torch, in blocks (combine_into)
        flat = t.view(-1)
        for s in range(0, flat.numel(), _GRAIN):
            flat[s:s + _GRAIN].div_(n)
    else:
        np.divide(t.numpy(), n, out=t.numpy())


def finish_avg_(t, world_size: int) -> None:
    """The last step of AVG: divide a SUM by the world size; nothing for float16 and bfloat16,
    whose parts were divided first (``avg_part``). Integer AVG floors, like ``sum // n``."""
    if divides_first(t.dtype):
        return
    if isinstance(t, np.ndarray):
        (np.divide if t.dtype.kind == "f" else np.floor_divide)(t, world_size, out=t)
        return
    torch = sys.modules["torch"]
    if t.is_floating_point():
        _divide_(t, world_size)
    elif t.device.type != "cpu":
        t.copy_(torch.div(t, world_size, rounding_mode="floor"))
    else:
        np.floor_divide(t.numpy(), world_size, out=t.numpy())
