"""Codec throughput on one core next to memcpy: ``python -m commrt.quant.speed [MiB]``.

GB/s counts the fp32 bytes going in (encode) or coming out (decode), so the figures compare
directly with a memcpy of the same fp32 buffer and with a link's speed.
"""
from __future__ import annotations

import sys
import time

import numpy as np

from commrt.quant.codecs import Codec


def _best(fn, repeat: int = 5) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(mib: float = 16.0) -> list[tuple[str, float]]:
    """(what, GB/s of fp32 data) for memcpy and each codec's encode / decode."""
    n = int(mib * (1 << 20)) // 4
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    dst = np.empty_like(x)
    rows = [("memcpy fp32", x.nbytes / _best(lambda: np.copyto(dst, x)) / 1e9)]
    for codec in (Codec(8), Codec(4), Codec(8, rounding="stochastic")):
        buf = np.empty(codec.nbytes(n), dtype=np.uint8)
        label = f"{codec.name} block {codec.block} {codec.rounding}"
        rows.append((f"encode {label}", x.nbytes / _best(lambda: codec.encode_into(buf, x)) / 1e9))
        rows.append((f"decode {label}", x.nbytes / _best(lambda: codec.decode(buf, n, out=dst)) / 1e9))
    return rows


if __name__ == "__main__":
    size = float(sys.argv[1]) if len(sys.argv) > 1 else 16.0
    for what, gbps in measure(size):
        sys.stdout.write(f"{what:<40} {gbps:6.2f} GB/s (fp32 bytes, one core)\n")
