"""Helpers for rank programs: an independent numpy/torch reference and value patterns."""
from __future__ import annotations

import numpy as np
import torch

import commrt
from tests.multirank.programs import np_ref

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16,
          torch.int8, torch.uint8, torch.int32, torch.int64]
OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX"]


def values(numel: int, rank: int, dtype: torch.dtype, op: str, seed: int) -> torch.Tensor:
    """Small integers (exact in every dtype, so results must match the reference exactly)."""
    return torch.from_numpy(np_ref.ints(numel, rank, op, seed, unsigned=dtype == torch.uint8)).to(dtype)


def reference(parts: list[torch.Tensor], op: str) -> torch.Tensor:
    """What a single process computes: numpy on float64/int64, then cast back. A float16 /
    bfloat16 AVG sums the parts divided by n (rounded to their dtype), as commrt does: the
    sums' rounding then depends on their order, so compare within the dtype's tolerance
    (exact where n is a power of two and the values small integers)."""
    dtype = parts[0].dtype
    if op == "AVG" and dtype in (torch.float16, torch.bfloat16):
        parts, op = [(p.double() / len(parts)).to(dtype) for p in parts], "SUM"
    wide = np.stack([(p.double() if p.is_floating_point() else p.long()).numpy() for p in parts])
    return torch.from_numpy(np_ref.reduce_wide(wide, op, dtype.is_floating_point)).to(dtype)


def assert_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    got, want = got.reshape(-1), want.reshape(-1)
    if got.dtype != want.dtype or got.numel() != want.numel():
        raise AssertionError(f"{what}: got {got.dtype}[{got.numel()}], want {want.dtype}[{want.numel()}]")
    # bfloat16 keeps 8 bits: its AVG's parts / n and their sums round by up to 2**-8 each
    tol = {torch.float16: 1e-2, torch.bfloat16: 4e-2}.get(want.dtype, 1e-6 if want.is_floating_point() else 0)
    ok = torch.allclose(got.double(), want.double(), rtol=tol, atol=tol) if want.is_floating_point() \
        else torch.equal(got, want)
    if not ok:  # the element furthest outside the tolerance
        excess = (got.double() - want.double()).abs() - tol * (1 + want.double().abs())
        bad = excess.nan_to_num(nan=float("inf")).argmax().item() if got.numel() else 0
        raise AssertionError(f"{what}: mismatch at {bad}: got {got[bad].item()}, want {want[bad].item()} "
                             f"(first values got {got[:6].tolist()}, want {want[:6].tolist()})")


def init() -> tuple[int, int]:
    commrt.init_process_group()
    return commrt.get_rank(), commrt.get_world_size()
