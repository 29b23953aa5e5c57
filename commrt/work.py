"""Async work handles and the per-group executor that runs operations in issue order."""
from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable

from .errors import CommError


class CommTimeout(CommError, TimeoutError):
    """``Work.wait(timeout)`` ran out before the operation finished."""


class Work:
    """Handle of an operation, like ``torch.distributed.Work``."""

    def __init__(self, name: str):
        self.name = name
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._result: Any = None

    def _finish(self, result: Any, error: BaseException | None) -> None:
        self._result, self._error = result, error
        self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done; re-raise the operation's error. ``timeout`` in seconds."""
        if not self._done.wait(timeout):
            raise CommTimeout(f"{self.name} did not complete within {timeout}s")
        if self._error is not None:
            raise self._error
        return True

    def result(self) -> Any:
        self.wait()
        return self._result


class Executor:
    """Runs one group's operations strictly in issue order, one at a time.

    Synchronous calls run inline in the caller's thread (no thread hop on the latency path)
    once every earlier asynchronous operation has finished; asynchronous calls go to one
    worker thread. Every group has its own executor, so groups progress independently.
    """

    def __init__(self, name: str):
        self.name = name
        self.lock = threading.Lock()  # held while an operation owns the group's sockets
        self._cv = threading.Condition()
        self._queue: collections.deque[tuple[Work, Callable[[], Any]]] = collections.deque()
        self._busy = False
        self._closed = False
        self._thread: threading.Thread | None = None

    def run(self, name: str, fn: Callable[[], Any], timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._queue or self._busy:
                if not self._cv.wait(max(0.0, deadline - time.monotonic())):
                    raise CommTimeout(f"{name} waited {timeout_s:g}s for earlier async ops on {self.name}")
        with self.lock:
            return fn()

    def submit(self, name: str, fn: Callable[[], Any]) -> Work:
        work = Work(name)
        with self._cv:
            if self._closed:
                raise CommError(f"{self.name} is closed")
            self._queue.append((work, fn))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=f"commrt-{self.name}", daemon=True)
                self._thread.start()
            self._cv.notify_all()
        return work

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                work, fn = self._queue.popleft()
                self._busy = True
            try:
                with self.lock:
                    result = fn()
                work._finish(result, None)
            except BaseException as exc:  # handed to the waiter, never lost
                work._finish(None, exc)
            with self._cv:
                self._busy = False
                self._cv.notify_all()

    def close(self, timeout_s: float = 5.0) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
