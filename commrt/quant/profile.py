"""Where a quantized two-hop call's time goes, per rank: ``[quant] profile = true`` (or
``COMMRT_QUANT_PROFILE=1``) sums
``time.perf_counter`` spans per phase (node-local reduce-scatter, encode, the cross-node
exchange, decode + reduce, node-local all-gather, copies) and logs them, with the bytes sent
across nodes, once at exit. Off (the default), ``span`` hands back one shared no-op context:
no clock is read. Spans nest only as the caller opens them; a waited-on asynchronous
collective is charged to the phase that waits for it.

The switch is the running job's config, not a module flag: every quantized call hands its
``[quant] profile`` to ``follow`` before it opens a span.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import time
from contextlib import nullcontext

_ON = [False]
"""The last quantized call's ``[quant] profile`` (see ``follow``)."""
_REPORTING: list = []  # holds the atexit registration once there is one
TOTALS: dict[str, float] = {}
TAG = [""]
"""Prefixed to every span's name: the caller sets it per call (e.g. the payload size)."""
COUNTS: dict[str, int] = {}
_OFF = nullcontext()
log = logging.getLogger(__name__)


class _Span:
    __slots__ = ("name", "t0", "c0")

    def __init__(self, name: str):
        self.name = TAG[0] + name

    def __enter__(self):
        self.t0, self.c0 = time.perf_counter(), time.process_time()

    def __exit__(self, *exc):
        TOTALS[self.name] = TOTALS.get(self.name, 0.0) + time.perf_counter() - self.t0
        COUNTS[self.name] = COUNTS.get(self.name, 0) + 1
        if self.name.endswith("total"):  # this process's CPU (all its threads, user + system)
            TOTALS[self.name + "_cpu"] = TOTALS.get(self.name + "_cpu", 0.0) + time.process_time() - self.c0


def follow(on: bool) -> None:
    """Profile from now on iff ``on`` (the caller's ``[quant] profile``); the first time it is
    on, the totals are logged at exit."""
    if on and not _REPORTING:
        _REPORTING.append(atexit.register(_report))
    _ON[0] = on


def enabled() -> bool:
    return _ON[0]


def span(name: str):
    return _Span(name) if _ON[0] else _OFF


def add(name: str, value: float) -> None:
    """Count a quantity (bytes, calls) beside the spans."""
    if _ON[0]:
        TOTALS[TAG[0] + name] = TOTALS.get(TAG[0] + name, 0.0) + value


def snapshot() -> dict[str, float]:
    return dict(TOTALS)


def reset() -> None:
    TOTALS.clear()
    COUNTS.clear()


def _report() -> None:
    if TOTALS:
        rank = os.environ.get("RANK", "?")
        log.warning("quant profile rank %s: %s", rank, json.dumps({k: round(v, 6) for k, v in TOTALS.items()}))

