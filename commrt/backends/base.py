"""The interface every backend implements for one process group, and buffer preparation
(numpy arrays stay numpy, tensors stay tensors: runtime/arrays.py)."""
from __future__ import annotations

import sys
from typing import Callable, Protocol

import numpy as np

from commrt.runtime import dtypes
from commrt.collectives.reduce_ops import ReduceOp
from commrt.runtime.work import Work


class Backend(Protocol):
    """One process group's communication; ranks here are group ranks."""
    name: str

    def all_reduce(self, tensor, op: ReduceOp, async_op: bool) -> Work | None: ...
    def reduce_scatter_tensor(self, output, input, op: ReduceOp, async_op: bool) -> Work | None: ...
    def all_gather_into_tensor(self, output, input, async_op: bool) -> Work | None: ...
    def broadcast(self, tensor, src: int, async_op: bool) -> Work | None: ...
    def reduce(self, tensor, dst: int, op: ReduceOp, async_op: bool) -> Work | None: ...
    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes,
                          async_op: bool) -> Work | None: ...
    def barrier(self, async_op: bool) -> Work | None: ...
    def isend(self, tensor, dst: int, tag: int) -> Work: ...
    def irecv(self, tensor, src: int, tag: int) -> Work: ...
    def close(self) -> None: ...


def narrow_int(buf) -> bool:
    """An integer buffer of fewer than 64 bits (bool is not a number here)."""
    if isinstance(buf, np.ndarray):
        return buf.dtype.kind in "iu" and buf.dtype.itemsize < 8
    return not (buf.is_floating_point() or buf.is_complex()) and buf.element_size() < 8 \
        and buf.dtype != sys.modules["torch"].bool


def widened(flat, op: ReduceOp, wb: Callable[[], None] | None, fresh: bool = False):
    """(buffer to reduce, write-back): an integer AVG narrower than 64 bits runs on a 64-bit
    copy, so that the sum of n values cannot wrap before the division (int8 100 on 3 ranks
    averaged to 14); the write-back stores the average, which fits, into ``flat`` and runs
    ``wb``. ``fresh``: an output the op fills, not read first (no copy of its values).
    Every rank of an AVG widens alike, so the wire sees one dtype."""
    if op != ReduceOp.AVG or not narrow_int(flat):
        return flat, wb
    if isinstance(flat, np.ndarray):
        wide = np.empty(flat.shape, np.int64) if fresh else flat.astype(np.int64)  # uint8 and int32 fit
        store = lambda: np.copyto(flat, wide, casting="unsafe")  # noqa: E731
    else:
        torch = sys.modules["torch"]
        wide = torch.empty(flat.shape, dtype=torch.int64) if fresh else flat.to(torch.int64)
        store = lambda: flat.copy_(wide)  # noqa: E731
    return wide, (lambda: (store(), wb and wb())) if wb else store


def plain(obj):
    """``flat_view``'s common case in a few attribute reads: a writable C-contiguous numpy
    array, or a contiguous CPU tensor outside autograd, of a dtype already seen on the wire,
    as a flat view (itself when 1-d); None for anything else, which flat_view then prepares or
    refuses with its errors. On the path of every small op (issue 32: the per-op cost)."""
    if type(obj) is np.ndarray:
        flags = obj.flags
        if flags.c_contiguous and flags.writeable and obj.dtype in dtypes.SEEN:
            return obj if obj.ndim == 1 else obj.reshape(-1)
        return None
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor) and obj.is_cpu and not obj.requires_grad \
            and obj.dtype in dtypes.SEEN and obj.is_contiguous():
        flat = obj if obj.dim() == 1 else obj.reshape(-1)
        return flat if flat.stride(0) == 1 else None  # one element "contiguous" at any stride
    return None


_AVG_AS_IS: dict = {}


def avg_as_is(dtype) -> bool:
    """An AVG over ``dtype`` runs on the caller's buffer as it is: a float or complex (no
    integer to widen, no bool to refuse: ``widened``, ``check_defined``). Cached per dtype: on
    the path of every averaging op (the training engines average every gradient)."""
    ok = _AVG_AS_IS.get(dtype)
    if ok is None:
        if isinstance(dtype, np.dtype):
            ok = dtype.kind in "fc"
        else:
            ok = bool(dtype.is_floating_point or dtype.is_complex)
        _AVG_AS_IS[dtype] = ok
    return ok


def flat_view(obj, what: str = "tensor", writes: bool = True) -> tuple[object, Callable[[], None] | None]:
    """A flat contiguous view of a CPU tensor/array, and a write-back for non-contiguous input.
    A CUDA tensor is staged: a pinned host copy, written back to the device afterwards.
    ``writes`` false: the op only reads it (a read-only array is fine: dtypes.as_buffer)."""
    t = dtypes.as_buffer(obj, writes)
    dtypes.code_of(t.dtype)
    if isinstance(t, np.ndarray):
        if t.flags.c_contiguous:
            return (t if t.ndim == 1 else t.reshape(-1)), None
        flat = np.ascontiguousarray(t).reshape(-1)
        return flat, lambda: np.copyto(t, flat.reshape(t.shape))
    if t.is_cpu and t.is_contiguous():  # the common case first: no torch.device object per call
        flat = t if t.dim() == 1 else t.reshape(-1)
        if flat.numel() == 1 and flat.stride(0) != 1:  # "contiguous" whatever its stride, as torch
            flat = flat.as_strided((1,), (1,))  # sees one element; a byte view needs stride 1
        return flat, None
    if t.device.type == "cuda":
        from commrt.backends.staging import host_copy
        return host_copy(t)
    if t.device.type != "cpu":
        raise TypeError(f"{what} is on {t.device}; this backend takes CPU or CUDA tensors")
    if t.is_contiguous():
        return t.reshape(-1), None
    flat = t.contiguous().reshape(-1)
    return flat, lambda: t.copy_(flat.view(t.shape))


def same_kind(a, b) -> tuple:
    """(a, b) as one kind of buffer: a numpy array beside a tensor becomes a tensor over the
    same memory (torch is loaded: a tensor exists), so the pair runs as tensors as it always did."""
    if isinstance(a, np.ndarray) != isinstance(b, np.ndarray):
        from_numpy = sys.modules["torch"].from_numpy
        tensor = lambda x: from_numpy(x if x.flags.writeable else x.copy()) if isinstance(x, np.ndarray) else x  # noqa: E731
        return tensor(a), tensor(b)
    return a, b


def check_same_dtype(a, b, op: str) -> None:
    if a.dtype != b.dtype:
        raise TypeError(f"{op}: output dtype {a.dtype} differs from input dtype {b.dtype}")


def split_bounds(numel: int, rows: int, splits, size: int, what: str) -> list[tuple[int, int]]:
    """Element bounds of all_to_all blocks from dim-0 split sizes (None = equal split)."""
    row = numel // rows if rows else 0
    if splits is None:
        if rows % size:
            raise ValueError(f"all_to_all_single: {what} dim 0 ({rows}) is not divisible by "
                             f"world size {size}; pass split sizes")
        splits = [rows // size] * size
    splits = list(splits)
    if len(splits) != size or sum(splits) != rows or min(splits) < 0:
        raise ValueError(f"all_to_all_single: {what} split sizes {splits} must be {size} "
                         f"non-negative numbers summing to dim 0 ({rows})")
    bounds, start = [], 0
    for s in splits:
        bounds.append((start, start + s * row))
        start += s * row
    return bounds
