"""torch.distributed Work handles over commrt's own Work.

One torch operation may be several commrt operations (a coalesced all_reduce, a list
all-gather staged through one flat buffer): the handle completes when the last of them has
finished and its copy-out (``after``) has run. Completion is pushed by commrt's executor
thread (``Work.add_done_callback``), so ``get_future()`` completes as soon as the data is
ready, without a thread parked per operation; DDP's comm hooks chain on that future.
"""
from __future__ import annotations

import datetime
import logging
import threading
from typing import Callable

import torch
import torch.distributed as dist

from ..work import CommTimeout

log = logging.getLogger(__name__)


class TorchWork(dist.Work):
    """``wait(timeout)``, ``is_completed()``, ``get_future()`` (value: the op's output tensors,
    as torch's backends give them) and ``exception()``."""

    def __init__(self, name: str, works: list, result: list, after: Callable[[], None] | None = None):
        super().__init__()
        self._name, self._result, self._after = name, result, after
        self._works = [w for w in works if w is not None]
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._future: torch.futures.Future = torch.futures.Future()
        if self._works:
            self._works[-1].add_done_callback(self._last_finished)  # ops finish in issue order
        else:
            self._complete()

    @classmethod
    def done(cls, name: str, result: list) -> TorchWork:
        """The handle of an operation that already ran (synchronously, inline)."""
        return cls(name, [], result)

    def _last_finished(self, _work) -> None:
        try:  # runs on commrt's executor thread: it must never raise there
            self._error = next((w.exception() for w in self._works if w.exception() is not None), None)
            self._complete()
        except BaseException as exc:  # a failing copy-out is the op's error, handed to the waiter
            log.debug("%s: completion failed: %s", self._name, exc)
            self._error = exc
            self._done.set()

    def _complete(self) -> None:
        if self._error is None and self._after is not None:
            try:
                self._after()
            except BaseException as exc:
                self._error = exc
        self._done.set()
        if self._error is not None:
            self._future.set_exception(self._error)
        else:
            self._future.set_result(self._result)

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self):
        return self._error

    def wait(self, timeout: datetime.timedelta | float | None = None) -> bool:
        """Block until the data is ready (every operation has its own peer deadlines, so this
        ends); ``timeout`` (torch: a timedelta, 0 meaning none) bounds it further."""
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
        if not self._done.wait(seconds if seconds and seconds > 0 else None):
            raise CommTimeout(f"{self._name} did not complete within {seconds:g}s")
        if self._error is not None:
            raise self._error
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future

    def result(self) -> list:
        self.wait()
        return self._result

    def synchronize(self) -> None:
        self.wait()
