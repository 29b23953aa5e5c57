"""torch.distributed Work handles over commrt's own Work.

One torch operation may be several commrt operations (a coalesced all_reduce, a list
all-gather staged through one flat buffer): the handle completes when the last of them has
finished and its copy-out (``after``) has run. Completion is pushed by commrt's executor
thread (``Work.add_done_callback``), so ``get_future()`` completes as soon as the data is
ready, without a thread parked per operation; DDP's comm hooks chain on that future.

A requested future is settled on a ``_Settler`` thread, not on the executor's: settling runs the
future's ``then`` callbacks, and a callback that starts another operation on the group and waits
for it (torch's PowerSGD hook: ``dist.all_reduce(..., async_op=True).get_future().wait()``) or
runs a synchronous one would wait for the executor thread that is running it (a hang, or the op
timeout's CommTimeout).
"""
from __future__ import annotations

import collections
import datetime
import logging
import threading
from typing import Callable

import torch
import torch.distributed as dist

from commrt.runtime.work import CommTimeout

log = logging.getLogger(__name__)


class _Set:
    """An event that is already set (the handle of a synchronous call needs no real one)."""

    @staticmethod
    def is_set() -> bool:
        return True

    @staticmethod
    def wait(_timeout=None) -> bool:
        return True


_SET = _Set()


class _Settler:
    """Runs jobs (a future's settlement and so its callbacks) on daemon threads of its own: an
    idle one if there is one, else a new one, so a callback that blocks (on a later operation
    whose settlement comes here too) never holds up the others. A thread idle for ``IDLE_S``
    ends."""

    IDLE_S = 30.0

    def __init__(self):
        self._cv = threading.Condition(threading.Lock())
        self._jobs: collections.deque = collections.deque()
        self._waiting = 0  # threads inside _cv.wait

    def submit(self, job: Callable[[], None]) -> None:
        with self._cv:
            self._jobs.append(job)
            if len(self._jobs) > self._waiting:
                threading.Thread(target=self._loop, name="commrt-tdist-future", daemon=True).start()
            else:
                self._cv.notify()

    def _loop(self) -> None:
        while True:
            with self._cv:
                if not self._jobs:
                    self._waiting += 1
                    try:
                        self._cv.wait(self.IDLE_S)
                    finally:
                        self._waiting -= 1
                    if not self._jobs:
                        return
                job = self._jobs.popleft()
            try:
                job()
            except BaseException as exc:  # a future's own callbacks' errors stay in their futures
                log.warning("settling a torch future failed: %s", exc)


_SETTLER = _Settler()


class TorchWork(dist.Work):
    """``wait(timeout)``, ``is_completed()``, ``get_future()`` (value: the op's output tensors,
    as torch's backends give them) and ``exception()``."""

    def __init__(self, name: str, works: list, result: list, after: Callable[[], None] | None = None):
        super().__init__()
        self._name, self._result, self._after = name, result, after
        self._works = [w for w in works if w is not None]
        self._error: BaseException | None = None
        self._future: torch.futures.Future | None = None  # made when asked for (not on the sync path)
        self._lock = threading.Lock()  # the future's creation vs. completion
        if self._works:
            self._done = threading.Event()
            self._works[-1].add_done_callback(self._last_finished)  # ops finish in issue order
        else:
            self._done = _SET  # ran synchronously: nothing to wait for
            self._finish_after()

    @classmethod
    def done(cls, name: str, result: list) -> TorchWork:
        """The handle of an operation that already ran (synchronously, inline)."""
        return cls(name, [], result)

    def _last_finished(self, _work) -> None:
        try:  # runs on commrt's executor thread: it must never raise there
            self._error = next((w.exception() for w in self._works if w.exception() is not None), None)
            self._finish_after()
        except BaseException as exc:  # a failing copy-out is the op's error, handed to the waiter
            self._error = exc
        with self._lock:
            self._done.set()
            future = self._future
        if future is not None:  # off this (executor) thread: see the module's docstring
            _SETTLER.submit(lambda: self._settle(future))

    def _finish_after(self) -> None:
        if self._error is None and self._after is not None:
            try:
                self._after()
            except BaseException as exc:
                log.debug("%s: copy-out failed: %s", self._name, exc)
                self._error = exc

    def _settle(self, future: torch.futures.Future) -> None:
        if self._error is not None:
            future.set_exception(self._error)
        else:
            future.set_result(self._result)

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
        future = self._future
        if future is not None and not future.done():  # its settler sets it at once (the callbacks
            try:                                      # run after): after wait(), the future is done
                future.wait()
            except BaseException:
                pass  # the op's error: raised below
        if self._error is not None:
            raise self._error
        return True

    def get_future(self) -> torch.futures.Future:
        with self._lock:
            if self._future is not None:
                return self._future
            future = self._future = torch.futures.Future()
            settle = self._done.is_set()  # else _last_finished will (it reads the future under the lock)
        if settle:
            self._settle(future)  # outside the lock: the future's callbacks run here
        return future

    def result(self) -> list:
        self.wait()
        return self._result

    def synchronize(self) -> None:
        self.wait()

    def _source_rank(self) -> int:
        """The sender's group rank, for a receive from any source (torch's ``recv`` asks)."""
        self.wait()
        return self._works[-1].result()
