"""Numpy-only ranks at 16..256 on this host (issue 32 items 2, 3, 5): one table row per world size.

    flock /work/notes/bench.lock python -m tests.perf.lean_scale 16 64 128 256
    python -m tests.perf.lean_scale --tensor 16      # the same ops on torch tensors (a torch rank)

Each size is one launch of tests/multirank/programs/lean_rank.py (the TCP path, as the scale
tests run it): init_process_group's duration (rendezvous + connections + the world barrier,
which includes waiting for the last rank to start), per-op wall time of a barrier and of 4 KiB
and 1 MiB all_reduce (medians and the slowest rank), messages per 4 KiB all_reduce from
comm_stats, and per-rank resources from comm_stats()["resources"]: open files after the small
all_reduces and after the 1 MiB ones, threads, RSS and peak RSS. Every result is checked in
the ranks against the single-process reference. ITERS in the environment sets ops per size.
"""
from __future__ import annotations

import os
import sys
import time

from tests.multirank.lean import launch, mem_available_kib, summary

ITERS = os.environ.get("ITERS", "20")
COLUMNS = [("init_s", "init s", 1, "{:.2f}"), ("barrier_us", "barrier us", 1, "{:.0f}"),
           ("ar4k_us", "4 KiB us", 1, "{:.0f}"), ("ar1m_us", "1 MiB us", 1, "{:.0f}"),
           ("msgs", "msgs", 1, "{:g}"), ("fds", "files", 1, "{:.0f}"), ("fds_after_1m", "files 1M", 1, "{:.0f}"),
           ("threads", "threads", 1, "{:.0f}"), ("rss_kib", "RSS MiB", 1 / 1024, "{:.1f}"),
           ("hwm_kib", "peak MiB", 1 / 1024, "{:.1f}")]


def row(n: int, mode: str) -> str:
    start = time.perf_counter()
    _, _, rows = launch(n, mode, ITERS, timeout_s=1200)
    wall = time.perf_counter() - start
    s = summary(rows)
    cells = [f"{fmt.format(s[key][0] * scale)} / {fmt.format(s[key][1] * scale)}" for key, _, scale, fmt in COLUMNS]
    # init's minimum: the last rank to start waits for nobody, so it shows rendezvous alone
    # rank 0 also serves the bootstrap store: one connection per rank
    return (f"| {n} | {mode} | {wall:.0f} | {s['init_s'][2]:.2f} | {rows[0]['fds']:.0f} | " + " | ".join(cells)
            + " |")


def main(argv: list[str]) -> None:
    mode = "tensor" if "--tensor" in argv else "scale"
    sizes = [int(a) for a in argv if not a.startswith("--")] or [16, 64, 128, 256]
    print("| ranks | buffers | launch s | init s (min) | rank 0 files | " + " | ".join(f"{title} (median / max)" for _, title, _, _ in COLUMNS) + " |")
    print("|" + "---|" * (len(COLUMNS) + 5))
    for n in sizes:
        if mem_available_kib() < n * (80 << 10):
            print(f"| {n} | skipped: {mem_available_kib() >> 10} MiB available |")
            continue
        print(row(n, mode), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
