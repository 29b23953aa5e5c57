"""Benchmark arithmetic, as in nccl-tests (doc/PERFORMANCE.md there): pure and unit-tested.

algbw = size / time. busbw rescales algbw by how much data each rank must move over its
link in an optimal algorithm, so that it is comparable with the link's bandwidth:
all_reduce 2(n-1)/n; reduce_scatter, all_gather, all_to_all (n-1)/n; broadcast, reduce and
sendrecv 1.
"""
from __future__ import annotations

import math

import torch

from commrt.runtime.errors import ConfigError
from commrt.obs.comms import COLLECTIVES, algbw, bus_factor, busbw  # noqa: F401 (the bench's arithmetic too)

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def parse_size(text: str | int) -> int:
    """'4K' -> 4096, '64M' -> 67108864, '1G', '128' (powers of 1024, like nccl-tests).
    ConfigError (a ValueError) for what is not a finite size, so ``commrt bench`` says which
    option instead of a traceback ('inf' was an OverflowError, '4T' float's own message)."""
    if isinstance(text, int):
        return text
    s = text.strip().upper()
    digits = s.rstrip("KMGIB")
    unit = s[len(digits):]
    try:
        value = float(digits) * _UNITS[unit]
    except (ValueError, KeyError):
        value = math.nan
    if not math.isfinite(value):
        raise ConfigError(f"cannot read size '{text}'; use e.g. 4096, 4K, 64M, 1G")
    return int(value)


def size_series(min_bytes: int, max_bytes: int, factor: float) -> list[int]:
    """min, min x factor, ... up to max, in whole bytes, each size once: a factor near 1 used to
    give the same truncated size several times (-b 1 -f 1.5: 1, 1, 2, 3, ...), each a row."""
    if not (0 < min_bytes <= max_bytes and 1 < factor < math.inf):  # nan fails too
        raise ConfigError(f"need 0 < minbytes <= maxbytes and a finite factor > 1, got {min_bytes}, {max_bytes}, "
                          f"{factor}")
    out, s = [], float(min_bytes)
    while s <= max_bytes:
        if not out or int(s) != out[-1]:
            out.append(int(s))
        s *= factor
    return out


def count_wrong(got: torch.Tensor, expected: torch.Tensor) -> int:
    """Elements off by more than the dtype's rounding allows (exact for integers)."""
    g, e = got.reshape(-1), expected.reshape(-1)
    if g.numel() != e.numel():
        return max(g.numel(), e.numel())
    if g.is_floating_point():
        tol = {torch.float16: 1e-2, torch.bfloat16: 2e-2}.get(g.dtype, 1e-5)
        close = torch.isclose(g.double(), e.double(), rtol=tol, atol=tol)
        return int((~close).sum())
    return int((g != e).sum())


def format_size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def shm_busbw_ceiling(collective: str, memcpy_gbs: float, reduce_gbs: float) -> float:
    """The busbw a shared-memory collective could at best reach, from one rank's memcpy and
    reduction (a+b -> out) bandwidth measured while every rank runs them at once.

    With shared memory the "link" is memory: each rank reduces its 1/n of the data straight
    from the peers' buffers ((n-1)/n of the bytes through the reduction) and copies the other
    ranks' results out ((n-1)/n through memcpy). busbw counts 2(n-1)/n bytes for an
    all_reduce, so its ceiling is 2 / (1/reduce + 1/memcpy); a reduce-scatter (and reduce)
    is bound by the reduction alone, the copying collectives by memcpy alone."""
    if memcpy_gbs <= 0 or reduce_gbs <= 0:
        return 0.0
    if collective == "all_reduce":
        return 2 / (1 / reduce_gbs + 1 / memcpy_gbs)
    if collective in ("reduce_scatter", "reduce"):
        return reduce_gbs
    if collective in ("all_gather", "broadcast", "all_to_all", "sendrecv"):
        return memcpy_gbs
    raise ValueError(f"unknown collective '{collective}'; valid: {list(COLLECTIVES)}")
