"""Per-op cost of small collectives through the public API (issue 17: small collectives).

    flock /work/notes/bench.lock python -m commrt.cli launch -n 2 -- python -m tests.perf.small_ops

Runs ``commrt.all_reduce`` (flight recorder on, as always) on float32 tensors, for each size:
``ITERS`` ops back to back (the mean per op), then ``SAMPLES`` ops each measured alone
(rewrite the input, barrier, one op; the slowest rank's time; the median). Rank 0 prints one
line per size. PROFILE=1 runs the back-to-back loop of the first size under cProfile on
rank 0 and prints the functions by own time. SIZES, ITERS, SAMPLES, INTRA (shm | tcp), INPUT (torch | numpy:
the buffers handed to commrt.all_reduce), SMALL ([comm] small_bytes) in the
environment override the defaults. To compare two trees, run this command alternately with
PYTHONPATH pointing at each (see docs/PERFORMANCE.md).
"""
from __future__ import annotations

import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import numpy as np
import torch

import commrt
from commrt.runtime.config import load_config

SIZES = [int(s) for s in os.environ.get("SIZES", "4096,65536,1048576").split(",")]
ITERS = int(os.environ.get("ITERS", "2000"))
SAMPLES = int(os.environ.get("SAMPLES", "200"))


def back_to_back(t: torch.Tensor, iters: int) -> float:
    commrt.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        commrt.all_reduce(t)
    took = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64)
    commrt.all_reduce(took, op="max")
    return float(took[0])


def alone(t: torch.Tensor, samples: int) -> float:
    mine = []
    for _ in range(samples):
        (t if isinstance(t, np.ndarray) else t.numpy()).fill(0.0)  # numpy: torch fills large tensors with threads
        commrt.barrier()
        start = time.perf_counter()
        commrt.all_reduce(t)
        mine.append(time.perf_counter() - start)
    took = torch.tensor(mine, dtype=torch.float64)
    commrt.all_reduce(took, op="max")
    return statistics.median(took.tolist())


def layers(nbytes: int, iters: int) -> dict[str, float]:
    """Per-op time of each layer of the shared-memory path, called directly (same processes,
    interleaved in blocks): the step alone (header, counter, wait), shm_ops.all_reduce on a
    prebuilt context, the backend's all_reduce, and commrt.all_reduce. Differences between
    neighbours are what each layer adds."""
    from commrt.collectives import shm_ops
    from commrt.collectives.context import Coll
    from commrt.collectives.reduce_ops import ReduceOp
    be = commrt.get_world_group().backend
    chan = be._shm
    t = np.zeros(nbytes // 4, np.float32) if os.environ.get("INPUT") == "numpy" else torch.zeros(nbytes // 4)
    if chan is None:
        return {}
    ctx = shm_ops.ShmContext(chan, be.group_id, be.rank, be.size, 1 << 40, Coll.ALL_REDUCE, t.dtype,
                             t.size if isinstance(t, np.ndarray) else t.numel(), 0, ReduceOp.SUM, 0, be.cfg.comm.small_bytes)
    from array import array
    import inspect
    new = "header" in inspect.signature(chan.begin).parameters  # an older tree takes 7 words
    words = array("q", range(8)) if new else tuple(range(1, 8))

    def step():
        chan.begin(words)
        chan.publish_and_wait("all_reduce", 0)
    runs = {"step": step, "shm_ops": lambda: shm_ops.all_reduce(ctx, t, ReduceOp.SUM),
            "backend": lambda: be.all_reduce(t, ReduceOp.SUM, False), "api": lambda: commrt.all_reduce(t)}
    times: dict[str, list[float]] = {k: [] for k in runs}
    # LAYERS_CLOCK=thread: this thread's CPU time (a loaded machine's preemption left out; the
    # waits spin, so a peer's lateness still counts)
    clock = time.thread_time if os.environ.get("LAYERS_CLOCK") == "thread" else time.perf_counter
    for _ in range(10):
        for name, fn in runs.items():
            commrt.barrier()
            start = clock()
            for _ in range(iters // 10):
                fn()
            times[name].append((clock() - start) / (iters // 10))
    pick = min if os.environ.get("LAYERS_STAT") == "min" else statistics.median  # min: a loaded machine
    return {k: pick(v) for k, v in times.items()}


def profile(t: torch.Tensor, iters: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    back_to_back(t, iters)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
    return out.getvalue()


def main() -> int:
    intra = os.environ.get("INTRA", "shm")
    comm = {"intra_node": intra, **({"small_bytes": int(os.environ["SMALL"])} if "SMALL" in os.environ else {})}
    cfg = load_config(None, {"comm": comm})
    commrt.init_process_group(config=cfg)
    rank, n = commrt.get_rank(), commrt.get_world_size()
    for nbytes in SIZES:
        t = np.zeros(nbytes // 4, np.float32) if os.environ.get("INPUT") == "numpy" else torch.zeros(nbytes // 4)
        iters = max(20, min(ITERS, ITERS * 65536 // nbytes))
        back_to_back(t, max(10, iters // 10))  # warm-up
        b2b = back_to_back(t, iters)
        one = alone(t, max(20, min(SAMPLES, SAMPLES * 65536 // nbytes)))
        if rank == 0:
            print(f"{intra} n={n} {nbytes:>9} B  back-to-back {b2b * 1e6:8.1f} us  alone {one * 1e6:8.1f} us",
                  flush=True)
    if os.environ.get("LAYERS") == "1":
        for nbytes in SIZES:
            got = layers(nbytes, ITERS)
            if rank == 0:
                print(f"layers n={n} {nbytes:>9} B  " + "  ".join(f"{k} {v * 1e6:7.1f} us" for k, v in got.items()),
                      flush=True)
    if os.environ.get("PROFILE") == "1":
        text = profile(torch.zeros(SIZES[0] // 4), ITERS)
        if rank == 0:
            print(text, flush=True)
    commrt.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
