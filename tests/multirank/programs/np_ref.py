"""The single-process reference of the rank programs on numpy arrays, for programs that never
import torch (common.py builds its torch tensors on these): small integer values, exact in every
dtype, and what one process computes from every rank's inputs."""
from __future__ import annotations

import numpy as np


def ints(numel: int, rank: int, op: str, seed: int, unsigned: bool = False) -> np.ndarray:
    """Rank ``rank``'s input as int64: small integers (products of +-1 and 2 for PRODUCT)."""
    rng = np.random.default_rng(seed * 1000 + rank)
    if op == "PRODUCT":
        return rng.choice([1, 2] if unsigned else [-1, 1, 2], size=numel).astype(np.int64)
    return rng.integers(0 if unsigned else -8, 9, size=numel).astype(np.int64)


def values(numel: int, rank: int, dtype, op: str = "SUM", seed: int = 0) -> np.ndarray:
    return ints(numel, rank, op, seed, unsigned=np.dtype(dtype) == np.uint8).astype(dtype)


def reduce_wide(wide: np.ndarray, op: str, floating: bool) -> np.ndarray:
    """``op`` over axis 0 of the ranks' inputs widened to float64 / int64 (AVG on integers floors)."""
    if op in ("SUM", "AVG"):
        r = wide.sum(0)
        if op == "AVG":
            r = r / len(wide) if floating else np.floor_divide(r, len(wide))
    elif op == "PRODUCT":
        r = wide.prod(0)
    elif op == "MAX":
        r = wide.max(0)
    else:
        r = wide.min(0)
    return np.ascontiguousarray(r)


def reference(parts: list[np.ndarray], op: str) -> np.ndarray:
    floating = np.issubdtype(parts[0].dtype, np.floating)
    wide = np.stack([p.astype(np.float64 if floating else np.int64) for p in parts])
    return reduce_wide(wide, op, floating).astype(parts[0].dtype)
