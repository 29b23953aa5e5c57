"""Messages one rank sends per small (4 KiB) all_reduce (the default table: recursive doubling),
as comm_stats() counts them, with the results checked: integer-valued sums equal the
single-process reference exactly, and a random float sum is close to it and bit-identical on
every rank (its digest is printed for the test to compare across ranks)."""
from __future__ import annotations

import hashlib

import numpy as np

import commrt

OPS = 10


def _floats(rank: int) -> np.ndarray:
    return np.random.default_rng(rank).standard_normal(1024).astype(np.float32)


def main() -> None:
    commrt.init_process_group()
    rank, n = commrt.get_rank(), commrt.get_world_size()
    t = np.arange(1024, dtype=np.float32)  # 4 KiB
    commrt.all_reduce(t)  # connects; not counted
    before = commrt.comm_stats()["by_op"]["all_reduce"]["messages"]
    for i in range(OPS):
        t = np.arange(1024, dtype=np.float32) * (rank + 1) + i
        commrt.all_reduce(t)
        want = np.arange(1024, dtype=np.float32) * (n * (n + 1) // 2) + i * n  # exact in fp32
        assert np.array_equal(t, want), (i, t[:4], want[:4])
    per_op = (commrt.comm_stats()["by_op"]["all_reduce"]["messages"] - before) / OPS
    t = _floats(rank)
    commrt.all_reduce(t)
    reference = sum(_floats(r).astype(np.float64) for r in range(n))
    assert np.allclose(t.astype(np.float64), reference, rtol=0, atol=1e-4 * n), np.abs(t - reference).max()
    digest = hashlib.sha256(t.tobytes()).hexdigest()[:16]
    print(f"rank {rank}: messages per all_reduce {per_op:g} float sum {digest}", flush=True)
    commrt.destroy_process_group()


if __name__ == "__main__":
    main()
