"""Warnings a peer can trigger at will (a wrong secret, a refused request) must not flood the
log: a client retrying in a loop wrote 1,241 lines in 17 s and a PS worker 21,000 (issue 30
item 14). ``RateLimited`` logs the first ``burst`` of each kind per ``interval_s``, counts the
rest, and says how many it held back when the kind next comes up after the interval (there is
no timer thread: a flood that stops is summarised by ``flush()``, which runs at exit, or by its
next occurrence).
"""
from __future__ import annotations

import atexit
import logging
import threading
import time
from typing import Callable

BURST = 5  # lines of one kind logged per interval before the rest are only counted
INTERVAL_S = 60.0


class RateLimited:
    """Wraps ``logger``; ``warning(key, msg, *args)`` with ``key`` naming the kind of event
    (e.g. the refused peer's claimed name is not part of it: a flood varies it)."""

    def __init__(self, logger: logging.Logger, burst: int = BURST, interval_s: float = INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic):
        self._log, self._burst, self._interval, self._clock = logger, burst, interval_s, clock
        self._lock = threading.Lock()
        self._kinds: dict[str, list] = {}  # key -> [window start, logged, held back]
        atexit.register(self.flush)  # else a flood that stopped was never counted (nothing else flushes)

    def warning(self, key: str, msg: str, *args) -> None:
        self.log(logging.WARNING, key, msg, *args)

    def log(self, level: int, key: str, msg: str, *args) -> None:
        now = self._clock()
        with self._lock:
            state = self._kinds.setdefault(key, [now, 0, 0])
            if now - state[0] >= self._interval:
                self._summarise(level, key, state, now)
            emit = state[1] < self._burst
            state[1 if emit else 2] += 1
            last = emit and state[1] == self._burst
        if emit:
            self._log.log(level, msg + (" (further %s warnings held back for %gs)" if last else ""),
                          *args, *((key, self._interval) if last else ()))

    def flush(self) -> None:
        """Say how many of each kind were held back, now."""
        now = self._clock()
        with self._lock:
            for key, state in self._kinds.items():
                self._summarise(logging.WARNING, key, state, now)

    def _summarise(self, level: int, key: str, state: list, now: float) -> None:
        if state[2]:
            self._log.log(level, "%d more %s warnings in the last %.0fs (not logged one by one)",
                          state[2], key, now - state[0])
        state[:] = [now, 0, 0]
