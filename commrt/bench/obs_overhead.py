"""What observing costs, per op: ``commrt launch -n 2 -- python -m commrt.bench.obs_overhead``.

Three modes alternate op by op in one job (so a loaded machine shifts them alike; medians of
single ops shrug off load spikes):
``none`` (no observer: no flight record, no log), ``flight`` (the default: the flight recorder
only) and ``comms`` (``[log] comms = true``: the flight recorder and the comms log). Rank 0
logs the median microseconds per op of each and the ratios.
"""
from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch

from commrt import distributed as dist
from commrt.obs.comms import CommsLog

log = logging.getLogger("commrt.bench.obs_overhead")


def _time(tensor, ops: int) -> float:
    """Mean microseconds per op of ``ops`` all_reduces (the warm-up)."""
    start = time.perf_counter()
    for _ in range(ops):
        dist.all_reduce(tensor)
    return (time.perf_counter() - start) / ops * 1e6


def hook_us(obs, ops: int = 20000) -> float:
    """Microseconds per op spent in the observer alone (no network): begin + a sync completion,
    as ``distributed._begin``/``_call`` do."""
    g = dist._rt().world
    tensor = torch.zeros(1024)
    start = time.perf_counter()
    for _ in range(ops):
        t = tensor
        obs.issued(obs.begin(g, "all_reduce", t.numel() * t.element_size(), t.dtype), None)
    return (time.perf_counter() - start) / ops * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m commrt.bench.obs_overhead")
    p.add_argument("--bytes", type=int, default=4096)
    p.add_argument("--samples", type=int, default=100)
    p.add_argument("--ops", type=int, default=50, help="all_reduces per sample")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dist.init_process_group()
    obs, tensor = dist._observer, torch.zeros(args.bytes // 4)  # zeros: sums never overflow
    # "none'" repeats "none": the spread between the two is this run's noise floor
    modes = {"none": None, "flight": None, "comms": CommsLog(), "none'": None}
    _time(tensor, args.ops)  # warm-up: connections, buffers
    times: dict[str, list[float]] = {m: [] for m in modes}
    names = list(modes)
    for s in range(args.samples * args.ops):  # op by op: a load spike hits one op, not a mode
        k = (s // len(names)) % len(names)
        mode = names[(s + k) % len(names)]  # every mode in every position of the rotation
        dist._observer = None if mode.startswith("none") else obs
        obs.comms = modes[mode]
        start = time.perf_counter()
        dist.all_reduce(tensor)
        times[mode].append((time.perf_counter() - start) * 1e6)
    dist._observer, obs.comms = obs, None
    if dist.get_rank() == 0:
        flight_us = statistics.median(hook_us(obs) for _ in range(5))
        obs.comms = CommsLog()
        comms_us = statistics.median(hook_us(obs) for _ in range(5))
        obs.comms = None
        log.info("observer alone, us/op: flight %.2f  flight+comms %.2f", flight_us, comms_us)
        med = {m: statistics.median(v) for m, v in times.items()}
        log.info("all_reduce %d B x %d ranks, median us/op: %s", args.bytes, dist.get_world_size(),
                 "  ".join(f"{m} {v:.1f}" for m, v in med.items()))
        log.info("flight/none %.4f  comms/flight %.4f  comms/none %.4f  (noise: none'/none %.4f)",
                 med["flight"] / med["none"], med["comms"] / med["flight"], med["comms"] / med["none"],
                 med["none'"] / med["none"])
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
