"""Hellos each rank reads from the bootstrap store, and the bytes rank 0's store serves them,
at n ranks laid out as nodes of 8 on this host (issue 32.5), before and after reading a peer's
hello on first dial:

    flock -x /tmp/w/cpu.lock python -m tests.perf.rendezvous_reads 16 64 256

For each size, two launches alternate: ``every`` drops the node variables in the ranks (their
layout then comes from the hosts, and every rank reads every hello, as every rank did before),
``lazy`` keeps them. Numpy-only ranks on the TCP path; each runs init (its barrier), one 4 KiB
all_reduce checked exactly against the single-process sum, and prints comm_stats()["rendezvous"]
and its init time. Rank 0's store serves the sum of every rank's hello bytes.
"""
from __future__ import annotations

import io
import os
import re
import statistics
import sys
import time

PER_NODE = 8


def rank() -> None:
    if os.environ.get("DROP_NODE_VARS"):
        for name in ("GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            os.environ.pop(name)
    import numpy as np
    import commrt
    r, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    start = time.perf_counter()
    commrt.init_process_group()
    init_s = time.perf_counter() - start
    x = np.full(512, r + 1, np.int64)
    commrt.all_reduce(x)
    assert (x == n * (n + 1) // 2).all(), f"rank {r}: all_reduce"
    s = commrt.comm_stats()["rendezvous"]
    print(f"RDZV {r} {int(s['lazy'])} {s['hellos_read']} {s['hello_bytes']} {init_s:.3f}", flush=True)
    commrt.destroy_process_group()


def one(n: int, mode: str) -> str:
    from commrt.launch import Nodes, launch
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root, "COMMRT_COMM_BACKEND": "zmq", "COMMRT_COMM_INTRA_NODE": "tcp",
           "COMMRT_COMM_TIMEOUT_S": "300", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    if mode == "every":
        env["DROP_NODE_VARS"] = "1"
    out = io.StringIO()
    started = time.perf_counter()
    result = launch(PER_NODE, [sys.executable, "-m", "tests.perf.rendezvous_reads", "--rank"], out=out,
                    timeout_s=1200, env=env, nodes=Nodes(n // PER_NODE, None))
    wall = time.perf_counter() - started
    rows = {int(m[0]): m[1:] for m in re.findall(r"RDZV (\d+) (\d) (\d+) (\d+) ([\d.]+)", out.getvalue())}
    if result.returncode != 0 or len(rows) != n:
        raise SystemExit(f"{mode} x{n}: {result.describe()}\n{out.getvalue()[-4000:]}")
    reads = sorted(int(v[1]) for r, v in rows.items() if r != 0)
    served = sum(int(v[2]) for v in rows.values())
    inits = sorted(float(v[3]) for v in rows.values())
    return (f"| {n} | {mode} | {int(rows[0][1])} | {statistics.median(reads):g} / {reads[-1]} | "
            f"{served / 1e3:.1f} | {served / n:.0f} | {inits[0]:.2f} | {wall:.0f} |")


def main(sizes: list[int]) -> None:
    print("| ranks | hellos read | rank 0 | other ranks: median / max | rank 0's store served, KB | "
          "per rank, B | init s (min) | launch s |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for n in sizes:
        for mode in ("every", "lazy"):
            print(one(n, mode), flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["--rank"]:
        rank()
    else:
        main([int(a) for a in sys.argv[1:]] or [16, 64, 256])
