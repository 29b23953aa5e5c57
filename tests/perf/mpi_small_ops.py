"""Open MPI's all-reduce, timed as ``tests/perf/small_ops.py`` times commrt's (the peer for issue
32's small-message target; needs mpi4py and Open MPI, which this project does not depend on):

    mpirun -n 8 python -m tests.perf.mpi_small_ops      # as root: --allow-run-as-root

float32 numpy buffers, ``MPI.IN_PLACE`` sum, for each size: ``ITERS`` ops back to back (the
slowest rank's mean per op), then ``SAMPLES`` ops each alone (rewrite the input, barrier, one op;
per sample the slowest rank's time; the median). Rank 0 prints one line per size in
small_ops.py's format. SIZES, ITERS, SAMPLES in the environment override the defaults.
"""
from __future__ import annotations

import os
import statistics
import time

import numpy as np
from mpi4py import MPI

SIZES = [int(s) for s in os.environ.get("SIZES", "4096,65536,1048576").split(",")]
ITERS = int(os.environ.get("ITERS", "2000"))
SAMPLES = int(os.environ.get("SAMPLES", "200"))


def back_to_back(comm, buf: np.ndarray, iters: int) -> float:
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(iters):
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    return comm.allreduce((time.perf_counter() - start) / iters, op=MPI.MAX)


def alone(comm, buf: np.ndarray, samples: int) -> float:
    mine = np.zeros(samples)
    for i in range(samples):
        buf.fill(0.0)
        comm.Barrier()
        start = time.perf_counter()
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        mine[i] = time.perf_counter() - start
    comm.Allreduce(MPI.IN_PLACE, mine, op=MPI.MAX)
    return statistics.median(mine.tolist())


def main() -> int:
    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    for nbytes in SIZES:
        buf = np.zeros(nbytes // 4, dtype=np.float32)
        iters = max(20, min(ITERS, ITERS * 65536 // nbytes))
        back_to_back(comm, buf, max(10, iters // 10))  # warm-up
        b2b = back_to_back(comm, buf, iters)
        one = alone(comm, buf, max(20, min(SAMPLES, SAMPLES * 65536 // nbytes)))
        if rank == 0:
            print(f"openmpi n={n} {nbytes:>9} B  back-to-back {b2b * 1e6:8.1f} us  alone {one * 1e6:8.1f} us",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
