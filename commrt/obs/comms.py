"""The comms log's arithmetic: size buckets, per-key timings and the summary table (pure).

Like DeepSpeed's comms_logger, with the nccl-tests definitions (commrt/bench/metrics.py):
algbw = bytes / time, busbw = algbw x the collective's bus factor at the group's size.
"""
from __future__ import annotations

import dataclasses
import math
import threading

# nccl-tests' definitions (doc/PERFORMANCE.md there): algbw = size / time; busbw rescales it by
# the data each rank must move over its link in an optimal algorithm: all_reduce 2(n-1)/n;
# reduce_scatter, all_gather, all_to_all (n-1)/n; broadcast, reduce and sendrecv 1.
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all", "sendrecv")


def bus_factor(collective: str, n: int) -> float:
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    if collective in ("reduce_scatter", "all_gather", "all_to_all"):
        return (n - 1) / n
    if collective in ("broadcast", "reduce", "sendrecv"):
        return 1.0
    raise ValueError(f"unknown collective '{collective}'; valid: {list(COLLECTIVES)}")


def algbw(nbytes: int, seconds: float) -> float:
    """GB/s (10^9 bytes, as nccl-tests)."""
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def busbw(collective: str, n: int, alg: float) -> float:
    return alg * bus_factor(collective, n)


SAMPLES = 1 << 16
"""Durations kept per key for the percentiles (the most recent ones; count and totals are exact)."""

# our op names -> nccl-tests' collective names (bus factors); barrier moves no payload
NCCL_NAMES = {"all_reduce": "all_reduce", "reduce_scatter_tensor": "reduce_scatter",
              "all_gather_into_tensor": "all_gather", "all_to_all_single": "all_to_all",
              "broadcast": "broadcast", "reduce": "reduce", "send": "sendrecv", "recv": "sendrecv"}


def bucket(nbytes: int) -> int:
    """The power of two at or above ``nbytes`` (0 for an empty op)."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of an ascending list."""
    if not sorted_values:
        return 0.0
    k = max(0, math.ceil(q / 100 * len(sorted_values)) - 1)
    return sorted_values[min(k, len(sorted_values) - 1)]


def busbw_factor(op: str, n: int) -> float:
    name = NCCL_NAMES.get(op)
    return bus_factor(name, n) if name is not None and n > 0 else 0.0


@dataclasses.dataclass
class Timings:
    count: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    samples: list = dataclasses.field(default_factory=list)

    def add(self, nbytes: int, seconds: float) -> None:
        self.count += 1
        self.nbytes += nbytes
        self.seconds += seconds
        self.samples.append(seconds)
        if len(self.samples) >= 2 * SAMPLES:  # amortised trim: keep the newest SAMPLES
            del self.samples[:-SAMPLES]


class CommsLog:
    """Counts and times ops per (op, size bucket, group, backend).

    Ops end on several threads at once (a sync op in the caller's, async ones on their group's
    executor, a send on the p2p engine's, a gloo op in whichever thread waits), often under one
    key: ``add`` and the snapshot in ``rows`` hold a lock, or two ends at once could count as
    one (``count += 1`` is a read and a write) or one of two new rows replace the other."""

    def __init__(self) -> None:
        self.table: dict[tuple, Timings] = {}
        self._lock = threading.Lock()  # uncontended: a few dozen ns an op

    def add(self, op: str, nbytes: int, group: int, backend: str, size: int, seconds: float) -> None:
        key = (op, bucket(nbytes), group, backend, size)
        with self._lock:
            t = self.table.get(key)
            if t is None:
                t = self.table[key] = Timings()
            t.add(nbytes, seconds)

    def rows(self) -> list[dict]:
        """One dict per key, most total time first: the data of ``commrt.comms_summary()``."""
        out = []
        with self._lock:  # a snapshot: ops may end while a program reads the table
            snapshot = [(key, t.count, t.nbytes, t.seconds, t.samples[-SAMPLES:]) for key, t in self.table.items()]
        for (op, buck, group, backend, size), count, nbytes, seconds, samples in snapshot:
            s = sorted(samples)
            alg = nbytes / seconds / 1e9 if seconds > 0 else 0.0
            out.append({"op": op, "bucket": buck, "group": group, "backend": backend, "group_size": size,
                        "count": count, "bytes": nbytes, "total_s": seconds,
                        "mean_us": seconds / count * 1e6, "p50_us": percentile(s, 50) * 1e6,
                        "p99_us": percentile(s, 99) * 1e6, "algbw_gbps": alg,
                        "busbw_gbps": alg * busbw_factor(op, size)})
        out.sort(key=lambda r: -r["total_s"])
        return out


def format_size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.4g} {unit}"
    return f"{nbytes} B"


def format_table(rows: list[dict]) -> str:
    """The table rank 0 logs at exit."""
    head = ("op", "bucket", "group", "backend", "count", "bytes", "mean us", "p50 us", "p99 us",
            "algbw GB/s", "busbw GB/s")
    lines = [head]
    for r in rows:
        lines.append((r["op"], format_size(r["bucket"]), str(r["group"]), r["backend"], str(r["count"]),
                      format_size(r["bytes"]), f"{r['mean_us']:.1f}", f"{r['p50_us']:.1f}",
                      f"{r['p99_us']:.1f}", f"{r['algbw_gbps']:.3f}", f"{r['busbw_gbps']:.3f}"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) if i > 0 else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths)))
                     for line in lines)
