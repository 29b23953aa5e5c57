"""Each operation measured alone, the way a training step calls it (``commrt bench --mode alone``).

A training step computes new gradients, then calls one collective, then computes again: the op
starts with its input freshly written (and caches evicted by that write), peers arriving at
about the same time, and nothing of the previous op still in flight. Back-to-back loops hide
all of that (sockets stay hot, the next op's pieces queue behind the last one's). So each
sample here rewrites the input, passes a barrier of the backend under test, times one op on
every rank, and the sample's time is the slowest rank's (the step waits for it). The figure is
the median of those, across samples, with backends alternating sample by sample in the same
processes so that the machine's noise falls on all of them alike.
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Callable, Sequence

import torch

from commrt.collectives.reduce_ops import ReduceOp
from commrt.bench import metrics

MODES = ("both", "back-to-back", "alone")


def parse_mode(text: str) -> tuple[bool, bool]:
    """(measure back-to-back, measure alone) for a ``--mode`` value."""
    if text not in MODES:
        raise ValueError(f"unknown bench mode '{text}'; valid: {list(MODES)}")
    return text != "alone", text != "back-to-back"


def slowest_per_sample(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Sample i's time is the slowest rank's time of sample i (rows: ranks, columns: samples)."""
    if not per_rank or any(len(r) != len(per_rank[0]) for r in per_rank):
        raise ValueError("every rank must report the same number of samples")
    return [max(col) for col in zip(*per_rank)]


def summarize(samples: Sequence[float], collective: str, n: int, nbytes: int) -> dict:
    """Median (the figure), 10th and 90th percentile of the slowest-rank sample times."""
    if not samples:
        raise ValueError("no samples")
    ordered = sorted(samples)
    # nearest rank: the smallest sample with at least q of them at or below it; int(q * n) was
    # one rank high (of 10 samples, p90 was the slowest and p10 the second fastest)
    pick = lambda q: ordered[max(0, math.ceil(q * len(ordered)) - 1)]
    med = statistics.median(ordered)
    alg = metrics.algbw(nbytes, med)
    return {"time_us": med * 1e6, "p10_us": pick(0.1) * 1e6, "p90_us": pick(0.9) * 1e6,
            "algbw": alg, "busbw": metrics.busbw(collective, n, alg), "samples": len(ordered)}


def gather_slowest(be, mine: list[float], device: torch.device) -> list[float]:
    """Every rank's per-sample times -> per-sample slowest: an element-wise MAX all_reduce."""
    t = torch.tensor(mine, dtype=torch.float64, device=device)
    be.all_reduce(t, ReduceOp.MAX, False)
    return [float(x) for x in t.cpu()]


def one_sample(be, refill: Callable[[], None], run: Callable[[], None],
               sync: Callable[[], None]) -> float:
    """Rewrite the input, line the ranks up, time one op on this rank (seconds)."""
    refill()
    sync()
    be.barrier(False)
    start = time.perf_counter()
    run()
    sync()  # NCCL returns before the GPU is done
    return time.perf_counter() - start


def interleave(samples: int, names: Sequence[str], sample: Callable[[str], float]) -> dict[str, list[float]]:
    """``samples`` rounds of one sample per backend, alternating: {name: [seconds, ...]}."""
    out: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(samples):
        for name in names:
            out[name].append(sample(name))
    return out
