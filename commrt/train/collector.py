"""Python's garbage collector at step boundaries (``[train] manual_gc_interval``).

Python's automatic collector runs when allocations outnumber deallocations, so in a training
step it runs at no step's choosing, on each rank at a different moment. A full (generation 2)
collection walks every tracked object, and importing torch leaves ~170,000 of them: 97-240 ms
on a 2-core machine (5 times a rank in a 2-stage pipeline bench run of ~35 s), and while one rank
collects, the ranks waiting on it stall too. On 2 ranks that was within the run-to-run spread
(docs/PERFORMANCE.md); the stall grows with the ranks that wait. Megatron-LM's ``--manual-gc`` and torchtitan's ``gc_freq``
do what this does:

- at the end of the first step, one full collection, then ``gc.freeze()``: what set-up made
  (modules, torch's and commrt's objects, the optimizer state) moves to a permanent generation
  that later collections do not walk (a full collection after it: ~0.004 ms here);
- the automatic collector off from then on;
- a full collection every ``interval`` steps, at the same step on every rank (ranks step
  together), so no rank stalls its peers mid-step.

Cyclic garbage made between two collections lives until the next one; objects freed by their
reference count (tensors, most of a step) are freed at once, as before. The collector is one per
process: it is turned back on, and the frozen objects unfrozen, when the last ``ManualGC`` of the
process is closed (``close()``), and not before.
"""
from __future__ import annotations

import gc
import threading
import time

from commrt.runtime.errors import ConfigError

_lock = threading.RLock()  # a ManualGC freed by the collection _start runs closes under it
_open = 0              # ManualGC objects of this process not closed yet
_was_enabled = True    # the collector's state before the first of them turned it off


def check_interval(interval) -> None:
    """``manual_gc_interval`` is an integer >= 0, or a ConfigError."""
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
        raise ConfigError(f"manual_gc_interval = {interval!r} is invalid; valid: an integer >= 0 "
                          "(0: Python's automatic collector)")


class CollectorTime:
    """Time Python's collector took in this process since ``start()``, by generation (a
    ``gc.callbacks`` entry; one per process however many are made). ``read()`` returns (seconds,
    full collections): what a step spent stopped in the collector, which the step's phases
    otherwise count as compute (``commrt bench train``'s gc column)."""

    _installed = False
    _seconds = [0.0, 0.0, 0.0]
    _counts = [0, 0, 0]
    _began: dict = {}

    @classmethod
    def _callback(cls, phase: str, info: dict) -> None:
        g = info.get("generation", 0)
        if phase == "start":
            cls._began[g] = time.perf_counter()
        elif g in cls._began:
            cls._seconds[g] += time.perf_counter() - cls._began.pop(g)
            cls._counts[g] += 1

    @classmethod
    def install(cls) -> None:
        with _lock:
            if not cls._installed:
                gc.callbacks.append(cls._callback)
                cls._installed = True

    @classmethod
    def read(cls) -> tuple[float, int]:
        """(seconds in every generation's collections, full collections) so far."""
        return sum(cls._seconds), cls._counts[2]


class ManualGC:
    """Collect every ``interval`` steps (``step(at=)``, else calls of ``step()``); 0: leave
    Python's collector alone."""

    def __init__(self, interval: int):
        check_interval(interval)
        self.interval, self.steps, self.collections = interval, 0, 0
        self._active = False

    def step(self, at: int | None = None) -> None:
        """Call once at the end of every training step, on every rank. ``at``: the number of
        steps done, as every rank counts them (a fault-tolerant replica that rejoined, or skipped
        ahead, is at the job's step, not at its own count of calls); default: the calls."""
        if not self.interval:
            return
        self.steps = self.steps + 1 if at is None else at
        if not self._active:
            self._start()
        elif self.steps % self.interval == 0:
            gc.collect()
            self.collections += 1

    def _start(self) -> None:
        global _open, _was_enabled
        with _lock:
            if _open == 0:
                _was_enabled = gc.isenabled()
            _open += 1
            self._active = True
            gc.disable()
            gc.collect()
            gc.freeze()
        self.collections += 1

    def close(self) -> None:
        """Hand the collector back (the last open ``ManualGC`` of the process turns it on again)."""
        global _open
        with _lock:
            if not self._active:
                return
            self._active = False
            _open -= 1
            if _open == 0:
                gc.unfreeze()
                if _was_enabled:
                    gc.enable()

    def __del__(self):  # a forgotten close() must not leave the process without its collector
        try:
            self.close()
        except Exception:  # interpreter shutdown: the module's globals may be gone
            pass
