"""Rank 0's bootstrap-store connections and memory at n ranks laid out as nodes of 8 on this
host (issue 32.5), with one connection per rank (``[cluster] store_proxy = false``) and with a
store proxy per node (the default), alternating in one run:

    flock -x /tmp/w/cpu.lock python -m tests.perf.store_connections 64 128

Numpy-only ranks on the TCP path; each runs init (its barrier) and one 4 KiB all_reduce checked
exactly against the single-process sum, then, with every rank still up, rank 0 counts the TCP
connections established on its store's port (/proc/net/tcp: the kernel's view, not ours) and
reports what its store says it served (comm_stats()["rendezvous"]), its RSS and open files; a
node's leader (rank 8) and another rank report their RSS and init time.
"""
from __future__ import annotations

import io
import os
import re
import statistics
import sys
import time

PER_NODE = 8


def _established_on(port: int) -> int:
    """ESTABLISHED TCP sockets whose local port is ``port`` (the store's side of each connection)."""
    count = 0
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        count += sum(1 for r in rows if int(r.split()[1].split(":")[1], 16) == port and r.split()[3] == "01")
    return count


def rank() -> None:
    import numpy as np
    import commrt
    r, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    start = time.perf_counter()
    commrt.init_process_group()
    init_s = time.perf_counter() - start
    x = np.full(512, r + 1, np.int64)
    commrt.all_reduce(x)
    assert (x == n * (n + 1) // 2).all(), f"rank {r}: all_reduce"
    commrt.barrier()
    s, res = commrt.comm_stats()["rendezvous"], commrt.comm_stats()["resources"]
    tcp = _established_on(int(os.environ["MASTER_PORT"])) if r == 0 else -1
    print(f"CONN {r} {int(s['store_via_proxy'])} {s['store_connections'] or 0} {tcp} "
          f"{res['rss_kib']} {res['open_files']} {init_s:.3f}", flush=True)
    commrt.barrier()  # rank 0 counts while every connection is still up
    commrt.destroy_process_group()


def one(n: int, proxy: str) -> str:
    from commrt.launch import Nodes, launch
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root, "COMMRT_COMM_BACKEND": "zmq", "COMMRT_COMM_INTRA_NODE": "tcp",
           "COMMRT_COMM_TIMEOUT_S": "300", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
           "COMMRT_CLUSTER_STORE_PROXY": proxy}
    out = io.StringIO()
    started = time.perf_counter()
    result = launch(PER_NODE, [sys.executable, "-m", "tests.perf.store_connections", "--rank"], out=out,
                    timeout_s=1200, env=env, nodes=Nodes(n // PER_NODE, None))
    wall = time.perf_counter() - started
    rows = {int(m[0]): [int(v) for v in m[1:6]] + [float(m[6])]
            for m in re.findall(r"CONN (\d+) (\d) (\d+) (-?\d+) (\d+) (\d+) ([\d.]+)", out.getvalue())}
    if result.returncode != 0 or len(rows) != n:
        raise SystemExit(f"proxy={proxy} x{n}: {result.describe()}\n{out.getvalue()[-4000:]}")
    zero, leader, other = rows[0], rows[PER_NODE], rows[PER_NODE + 1]
    proxied = sum(v[0] for v in rows.values())
    inits = sorted(v[5] for v in rows.values())
    return (f"| {n} | {proxy} | {proxied} | {zero[1]} | {zero[2]} | {zero[3] / 1024:.1f} | {zero[4]} | "
            f"{leader[3] / 1024:.1f} | {other[3] / 1024:.1f} | {statistics.median(inits):.2f} | {wall:.0f} |")


def main(sizes: list[int]) -> None:
    print("| ranks | store_proxy | ranks via a proxy | rank 0's store served | established on its port | "
          "rank 0 RSS MiB | rank 0 open files | leader (rank 8) RSS MiB | rank 9 RSS MiB | init s (median) | "
          "launch s |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in sizes:
        for proxy in ("false", "true", "false", "true"):
            print(one(n, proxy), flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["--rank"]:
        rank()
    else:
        main([int(a) for a in sys.argv[1:]] or [64])
