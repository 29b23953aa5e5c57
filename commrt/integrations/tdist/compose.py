"""Pure helpers: torch's list-shaped operations as commrt's flat ones.

A list all-gather is an all-gather into one flat buffer, then a copy-out; gather and scatter are
all-to-alls in which only the root's blocks are non-empty; bitwise reductions (which commrt's
wire does not carry) are an all-gather followed by a local fold. No I/O here.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from commrt.collectives.reduce_ops import ReduceOp

_BITWISE = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}
_VIEW_AS = {torch.bool: torch.uint8}  # the same bytes, reduced by MAX / MIN (``bool_op``)


def op_name(op) -> str:
    """``'SUM'``, ``'AVG'``, ``'BAND'``... from a torch ReduceOp, RedOpType or name."""
    return str(getattr(op, "op", op)).rsplit(".", 1)[-1].upper()


def reduce_op(op, dtype: torch.dtype | None = None) -> ReduceOp | None:
    """commrt's op for a torch one on tensors of ``dtype``; None for the bitwise ops (folded
    locally, see ``fold``). ``bool`` travels as bytes, so its ops are torch's logical ones."""
    if dtype == torch.bool:
        return bool_op(op)
    if dtype is not None and dtype.is_complex:
        return complex_op(op)
    kind = getattr(op, "op", op)
    try:
        return _BY_KIND[kind]  # the common case: one dict look-up per call
    except (KeyError, TypeError):
        pass
    name = op_name(op)
    if name in _BITWISE:
        if dtype is not None and dtype.is_floating_point:  # else found only by the fold, after the traffic
            raise ValueError(f"commrt backend: {name} is not defined for floating-point tensors ({dtype})")
        return None
    if name == "PREMUL_SUM":
        raise NotImplementedError("commrt backend: PREMUL_SUM is not supported; scale the tensor "
                                  "and use SUM (what NCCL's premul does)")
    return ReduceOp[name]


def bool_op(op) -> ReduceOp | None:
    """torch's contract for ``bool`` (as gloo and NCCL keep it): SUM and MAX are a logical OR,
    PRODUCT and MIN a logical AND; on bytes that are 0 or 1 these are MAX and MIN, which cannot
    wrap (a byte SUM of True at 256 ranks is 0, False). AVG of truth values has no meaning."""
    name = op_name(op)
    if name in _BITWISE:
        return None
    if name in ("SUM", "MAX"):
        return ReduceOp.MAX
    if name in ("PRODUCT", "MIN"):
        return ReduceOp.MIN
    raise ValueError(f"commrt backend: {name} is not defined for bool tensors; valid: "
                     "SUM/MAX (logical or), PRODUCT/MIN (logical and), BAND, BOR, BXOR")


def complex_op(op) -> ReduceOp:
    """Complex tensors travel as their (real, imaginary) pairs, on which only SUM and AVG mean
    what they mean on the complex values (torch refuses the others for complex, as here)."""
    name = op_name(op)
    if name not in ("SUM", "AVG"):
        raise ValueError(f"commrt backend: {name} is not defined for complex tensors; valid: SUM, AVG")
    return ReduceOp[name]


_BY_KIND = {getattr(dist.ReduceOp, n): ReduceOp[n] for n in ReduceOp.__members__}


def fold(op, gathered: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` = the bitwise ``op`` over ``gathered``'s rows (one per rank)."""
    out.copy_(functools.reduce(_BITWISE[op_name(op)], gathered.unbind(0)).view(out.shape))


def wire_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a dtype commrt's wire carries (bool as uint8, complex as its real pairs, with
    a last dimension of 2; same memory)."""
    if t.is_complex():
        return torch.view_as_real(t)
    view = _VIEW_AS.get(t.dtype)
    return t if view is None else t.view(view)


def wire_numel(t: torch.Tensor) -> int:
    """Elements of ``wire_view(t)`` (twice ``t.numel()`` for complex)."""
    return t.numel() * (2 if t.is_complex() else 1)


def flat_cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One flat host buffer holding ``tensors`` one after another."""
    if not tensors:
        return torch.empty(0)
    return torch.cat([wire_view(t).detach().reshape(-1).cpu() for t in tensors])


def copy_out(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Scatter ``flat`` back into ``tensors`` (the inverse of ``flat_cat``)."""
    start = 0
    for t in tensors:
        w = wire_view(t)
        w.copy_(flat[start:start + w.numel()].view(w.shape))
        start += w.numel()


def same_dtype(tensors: list[torch.Tensor], what: str) -> None:
    if len({t.dtype for t in tensors}) > 1:
        raise TypeError(f"{what}: all tensors must have one dtype, got {sorted({str(t.dtype) for t in tensors})}")


def rooted_splits(size: int, root: int, rank: int, counts: list[int], mine: int) -> tuple[list[int], list[int]]:
    """(input splits, output splits) in elements for a gather to ``root`` as an all-to-all:
    every rank sends its ``mine`` elements to the root alone, the root receives ``counts``."""
    send = [mine if r == root else 0 for r in range(size)]
    recv = counts if rank == root else [0] * size
    return send, recv


def to_host(t: torch.Tensor) -> torch.Tensor:
    return t if t.device.type == "cpu" else t.cpu()
