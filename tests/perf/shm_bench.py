"""Shared memory against TCP and gloo, op by op, in the same processes (issue 17's figures).

    flock /work/notes/bench.lock python -m commrt.cli launch -n 2 -- \\
        python -m tests.perf.shm_bench [COLL ...]

For each size and sample: rewrite the input, barrier, time one op; the slowest rank's time,
the median over samples; backends alternate sample by sample. Prints busbw (nccl-tests'
convention) per backend and the ratio of each to gloo. COLL: all_reduce (default),
reduce_scatter, all_gather. SIZES / SAMPLES in the environment override the defaults.
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time

import torch

from commrt.runtime import bootstrap, rendezvous
from commrt.collectives.reduce_ops import ReduceOp
from commrt.runtime.config import load_config
from commrt.transport import Transport

SIZES = [int(s) for s in os.environ.get("SIZES", "4096,65536,1048576,16777216,67108864").split(",")]
SAMPLES = int(os.environ.get("SAMPLES", "9"))
BACKENDS = {"shm": ("zmq", "shm"), "tcp": ("zmq", "tcp"), "gloo": ("gloo", "tcp")}
# SLOTS=1048576,... adds shared-memory runtimes with those slot sizes (shm<bytes>) to compare
SLOTS = [int(s) for s in os.environ.get("SLOTS", "").split(",") if s]


def _op(be, coll: str, n: int, nbytes: int):
    m = max(1, nbytes // 4 // n)
    if coll == "all_reduce":
        t = torch.ones(m * n)
        return t, lambda: be.all_reduce(t, ReduceOp.SUM, False), 2 * (n - 1) / n
    if coll == "reduce_scatter":
        t, out = torch.ones(m * n), torch.empty(m)
        return t, lambda: be.reduce_scatter_tensor(out, t, ReduceOp.SUM, False), (n - 1) / n
    t, out = torch.ones(m), torch.empty(m * n)
    return t, lambda: be.all_gather_into_tensor(out, t, False), (n - 1) / n


def sample(be, t: torch.Tensor, run) -> float:
    t.fill_(1.0)
    be.barrier(False)
    start = time.perf_counter()
    run()
    took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    be.all_reduce(took, ReduceOp.MAX, False)
    return float(took[0])


def main() -> int:
    colls = sys.argv[1:] or ["all_reduce"]
    rdzv = rendezvous.resolve("env://", None, None, os.environ)
    cfg = load_config()
    transport = Transport(cfg, f"rank{rdzv.rank}")
    store, server = bootstrap.open_store(transport, rdzv, cfg.comm.timeout_s)
    rts = {}
    backends = {**BACKENDS, **{f"shm{s}": ("zmq", "shm", s) for s in SLOTS}}
    for name, (backend, intra, *slot) in backends.items():
        c = dataclasses.replace(cfg, comm=dataclasses.replace(cfg.comm, backend=backend, intra_node=intra,
                                                              shm_slot_bytes=slot[0] if slot else cfg.comm.shm_slot_bytes))
        rts[name] = bootstrap.init_world(c, rdzv, store=(store, None), namespace=f"{name}/")
    n = rdzv.world_size
    for coll in colls:
        if rdzv.rank == 0:
            print(f"# {coll} n={n}: busbw GB/s (median of {SAMPLES}, slowest rank), ratio to gloo", flush=True)
        for nbytes in SIZES:
            cases = {name: _op(rt.world.backend, coll, n, nbytes) for name, rt in rts.items()}
            times: dict = {name: [] for name in rts}
            for i in range(SAMPLES + 1):
                for name, rt in rts.items():
                    t, run, factor = cases[name]
                    took = sample(rt.world.backend, t, run)
                    if i:  # the first sample of each is warm-up
                        times[name].append(took)
            if rdzv.rank == 0:
                med = {k: statistics.median(v) for k, v in times.items()}
                bw = {k: factor * nbytes / v / 1e9 for k, v in med.items()}
                cells = "  ".join(f"{k} {med[k] * 1e6:9.1f}us {bw[k]:6.2f}GB/s x{med['gloo'] / med[k]:4.2f}"
                                  for k in rts)
                print(f"{nbytes:>10}  {cells}", flush=True)
    for rt in rts.values():
        bootstrap.shutdown(rt, keep_store=True)
    store.close()
    if server is not None:
        server.close()
    transport.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
