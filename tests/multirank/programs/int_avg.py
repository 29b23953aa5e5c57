"""Integer AVG near the top of its dtype: all_reduce, reduce_scatter_tensor and reduce on values
whose sum over the ranks does not fit the dtype, against the reference that sums in int64 and
floors (np_ref). The sum used to wrap before the division (int8 100 on 3 ranks gave 14).

    int_avg
"""
from __future__ import annotations

import numpy as np

import commrt
from tests.multirank.programs.np_ref import reference

HIGH = {np.int8: 100, np.uint8: 200, np.int32: 2**30, np.int64: 2**40}


def inputs(dtype, numel: int, rank: int) -> np.ndarray:
    """Large values, a little different on every rank and element (some negative for signed)."""
    base = np.full(numel, HIGH[dtype], np.int64) - (np.arange(numel) + rank) % 7
    if np.dtype(dtype).kind == "i":
        base[::5] *= -1
    return base.astype(dtype)


def checks() -> None:
    """Every check, on the initialized world (programs/dtype_ops.py runs it beside the others)."""
    rank, n = commrt.get_rank(), commrt.get_world_size()
    for dtype in HIGH:
        parts = [inputs(dtype, 11 * n, r) for r in range(n)]
        want = reference(parts, "AVG")
        t = parts[rank].copy()
        commrt.all_reduce(t, op="avg")
        assert np.array_equal(t, want), f"all_reduce {np.dtype(dtype)}: {t} != {want}"
        out = np.zeros(11, dtype)
        commrt.reduce_scatter_tensor(out, parts[rank].copy(), op="avg")
        assert np.array_equal(out, want[rank * 11:(rank + 1) * 11]), f"reduce_scatter {np.dtype(dtype)}"
        t = parts[rank].copy()
        commrt.reduce(t, dst=n - 1, op="avg")
        assert np.array_equal(t, want if rank == n - 1 else parts[rank]), f"reduce {np.dtype(dtype)}"
    commrt.barrier()
    print(f"rank {rank}: int avg passed", flush=True)


def main() -> None:
    commrt.init_process_group()
    checks()
    commrt.destroy_process_group()


if __name__ == "__main__":
    main()
