"""Launch the numpy-only rank program (programs/lean_rank.py) and read its LEAN lines: shared by
the scale tests and tests/perf/lean_scale.py."""
from __future__ import annotations

import re
import statistics

from tests.multirank.harness import run_ranks

# the TCP path, lazily dialled (shared memory between the ranks of a host dials every peer at
# once); one BLAS thread per rank (numpy's OpenBLAS starts one per core otherwise)
ENV = {"COMMRT_COMM_BACKEND": "zmq", "COMMRT_COMM_INTRA_NODE": "tcp", "OMP_NUM_THREADS": "1",
       "OPENBLAS_NUM_THREADS": "1", "COMMRT_COMM_TIMEOUT_S": "180"}
FIELDS = ("init_s", "barrier_us", "ar4k_us", "ar1m_us", "msgs", "fds", "threads", "rss_kib", "hwm_kib",
          "fds_after_1m", "torch")
LINE = re.compile(r"LEAN rank (\d+) world \d+ " + " ".join(rf"{f} ([\d.]+)" for f in FIELDS) + r" digest (\w+)")


def parse(out: str) -> dict[int, dict]:
    """rank -> its figures (and ``digest``)."""
    rows = {}
    for m in LINE.finditer(out):
        rows[int(m.group(1))] = {**dict(zip(FIELDS, map(float, m.groups()[1:-1]))), "digest": m.groups()[-1]}
    return rows


def launch(nproc: int, mode: str, *args: str, timeout_s: float, env: dict | None = None, **kw):
    """(result, output, rows) of one run of lean_rank."""
    result, out = run_ranks(nproc, "lean_rank", mode, *args, env={**ENV, **(env or {})},
                            timeout_s=timeout_s, **kw)
    return result, out, parse(out)


def summary(rows: dict[int, dict]) -> dict[str, tuple[float, float, float]]:
    """field -> (median, max, min) over the ranks."""
    return {f: (statistics.median(r[f] for r in rows.values()), max(r[f] for r in rows.values()),
                min(r[f] for r in rows.values())) for f in FIELDS}


def mem_available_kib() -> int:
    with open("/proc/meminfo") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("MemAvailable"))
