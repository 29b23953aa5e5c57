"""All_reduce of CUDA tensors over zmq against the same on CPU tensors (issue 34, item 2): the
staging's cost. Run as ranks: ``python -m commrt.cli launch -n 2 -- python -m
tests.gpu.staging_timing OUT.json`` (the ranks may share one GPU). For each smallest piece
size and tensor size, CUDA and CPU calls alternate (this machine's noise hits both alike);
rank 0 writes the medians and their ratio. Each size's CUDA result is checked against the CPU
one first, so a fast wrong staging cannot pass."""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

import commrt
from commrt.backends import staging

SIZES_MIB = (1, 16, 64)
MIN_PIECES = (256 << 10, 1 << 20, 4 << 20)
REPS = int(os.environ.get("STAGING_REPS", "15"))


def _timed(t: torch.Tensor) -> float:
    commrt.barrier()
    start = time.perf_counter()
    commrt.all_reduce(t)
    if t.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> int:
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    commrt.init_process_group(backend="zmq")
    rank = commrt.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    rows = []
    for min_piece in MIN_PIECES:
        staging.MIN_PIECE_BYTES = min_piece
        for mib in SIZES_MIB:
            n = (mib << 20) // 4
            cpu = torch.arange(n, dtype=torch.float32) % 251 + rank
            gpu = cpu.to(dev)
            commrt.all_reduce(cpu)
            commrt.all_reduce(gpu)
            if not torch.equal(gpu.cpu(), cpu):
                raise AssertionError(f"rank {rank}: staged CUDA all_reduce of {mib} MiB differs from the CPU one")
            tc, tg = [], []
            for _ in range(REPS):
                tc.append(_timed(cpu))
                tg.append(_timed(gpu))
            c, g = statistics.median(tc), statistics.median(tg)
            rows.append(dict(min_piece_kib=min_piece >> 10, mib=mib, cpu_ms=round(c * 1e3, 3),
                             cuda_ms=round(g * 1e3, 3), ratio=round(g / c, 3),
                             pieces=len(staging.piece_bounds(n, 4, 4 * (4 << 20)))))
            if rank == 0:
                print(rows[-1], flush=True)
    if rank == 0:
        json.dump({"device": torch.cuda.get_device_name(dev), "reps": REPS, "rows": rows},
                  open(sys.argv[1], "w"), indent=1)
    commrt.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
