"""Async work handles and the per-group executor that runs operations in issue order."""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Callable

from commrt.runtime.errors import CommError

log = logging.getLogger(__name__)

_CALLBACK_LOCK = threading.Lock()  # registering vs. finishing: every callback runs exactly once
on_turn = threading.local()
"""``on_turn.hook``: called (once, then cleared) when the next synchronous ``Executor.run`` of
this thread gets its group's turn after waiting for it: how the public API's flight record of a
sync op learns when it really started, behind the async ops queued before it (commrt/obs)."""


class Flag:
    """``threading.Event``'s interface, the Event made only when a waiter must block.

    Most operations are done before anyone waits (a send the socket took at once, a receive the
    waiting thread landed itself), and an Event costs ~2 us to make and ~1 us to set: a large
    part of a small point-to-point message's own time (issue 29). ``set`` runs under
    ``_CALLBACK_LOCK`` (``Work._finish``), and a blocking waiter makes the Event under it too,
    so either the setter sees the Event or the waiter sees the flag."""

    __slots__ = ("_set", "_event")

    def __init__(self) -> None:
        self._set = False
        self._event: threading.Event | None = None

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        with _CALLBACK_LOCK:
            self._set_locked()

    def _set_locked(self) -> None:
        self._set = True
        if self._event is not None:
            self._event.set()

    def wait(self, timeout: float | None = None) -> bool:
        if self._set:
            return True
        with _CALLBACK_LOCK:
            if self._set:
                return True
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        return event.wait(timeout)


class CommTimeout(CommError, TimeoutError):
    """``Work.wait(timeout)`` ran out before the operation finished."""


class Work:
    """Handle of an operation, like ``torch.distributed.Work``."""

    _flight = None
    """The op's flight-recorder record (commrt/obs), told when the op starts and ends."""
    _ended_at: float | None = None
    """perf_counter when the op ended, where that is known before ``_finish`` runs (a gloo
    collective's future, integrations/torch_backend.py); None: ``_finish``'s own time."""

    def __init__(self, name: str):
        self.name = name
        self._done = Flag()
        self._error: BaseException | None = None
        self._result: Any = None
        self._callbacks: list[Callable[[Work], None]] | None = None

    def _finish(self, result: Any, error: BaseException | None) -> None:
        with _CALLBACK_LOCK:  # uncontended: once per operation, not per message
            self._result, self._error = result, error
            self._done._set_locked()
            callbacks, self._callbacks = self._callbacks or (), None
        if self._flight is not None:
            self._flight.done(error, self._ended_at)
        for fn in callbacks:
            self._call_back(fn)

    def _call_back(self, fn: Callable[[Work], None]) -> None:
        """``fn(self)``; its error is logged, never raised: it must not skip the other callbacks,
        nor turn this op, finished, into a failed one (the executor's loop catches what
        ``_finish`` raises), as torch logs a raising future callback."""
        try:
            fn(self)
        except Exception:
            log.exception("a done-callback of %s raised (the operation itself %s)", self.name,
                          "failed" if self._error is not None else "succeeded")

    def add_done_callback(self, fn: Callable[[Work], None]) -> None:
        """Call ``fn(self)`` once the operation has finished (at once if it has), in the thread
        that finished it: how torch's futures (commrt/tdist) learn of completion without a
        thread waiting per operation. ``fn`` must not start a synchronous operation on the same
        group (that thread still holds the group's turn)."""
        with _CALLBACK_LOCK:
            if not self._done.is_set():
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(fn)
                return
        self._call_back(fn)

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done; re-raise the operation's error. ``timeout`` in seconds."""
        if not self._done.wait(timeout):
            raise self._timeout(timeout)
        if self._error is not None:
            raise self._error
        return True

    def result(self) -> Any:
        self.wait()
        return self._result

    def _timeout(self, timeout: float) -> CommTimeout:
        """The error of a wait that ran out (the op stays pending), told to the op's flight
        record first (a rank that gives up may be stuck: the recorder dumps). Every backend's
        Work raises its timeouts through here."""
        exc = CommTimeout(f"{self.name} did not complete within {timeout}s")
        if self._flight is not None:
            self._flight.timed_out(exc)
        return exc


class Executor:
    """Runs one group's operations strictly in issue order, one at a time.

    Synchronous calls run inline in the caller's thread (no thread hop on the latency path)
    once every earlier asynchronous operation has finished; asynchronous calls go to one
    worker thread. Whoever runs the current operation owns the group's sockets (transport.py's
    rules): the "turn" is taken and given back under ``_cv`` together with the queue, so an
    operation's position, its sequence number (assigned when it starts) and its turn agree.
    Every group has its own executor, so groups progress independently.
    """

    def __init__(self, name: str):
        self.name = name
        self._lock = threading.Lock()  # taken directly where nobody waits: Condition's own
        self._cv = threading.Condition(self._lock)  # __enter__/__exit__ are Python calls
        self._queue: collections.deque[tuple[Work, Callable[[], Any]]] = collections.deque()
        self._busy = False  # an operation holds the turn
        self._closed: Callable[[str], BaseException] | None = None
        self._thread: threading.Thread | None = None
        self.finished = 0  # operations completed: progress that waiting callers watch
        self._waiting = 0  # threads inside _cv.wait: _done wakes nobody when there are none

    def run(self, name: str, fn: Callable[..., Any], timeout_s: float, *args) -> Any:
        """Run ``fn(*args)`` inline after every earlier operation. Time spent queued behind work
        that progresses is not anybody's silence: the wait gives up (CommTimeout) only when no
        earlier operation finished for ``timeout_s`` (each has its own peer deadlines)."""
        with self._lock:
            waited = bool(self._queue or self._busy)
            if waited:
                self._wait_turn(name, timeout_s)
            if self._closed is not None:
                raise self._closed(name)
            self._busy = True
        try:
            if waited:  # else its turn came at issue: nothing to tell (the common, small-op case)
                hook = getattr(on_turn, "hook", None)
                if hook is not None:
                    on_turn.hook = None
                    hook()
            return fn(*args)
        finally:
            self._done()

    def _wait_turn(self, name: str, timeout_s: float) -> None:
        last, deadline = self.finished, time.monotonic() + timeout_s
        while (self._queue or self._busy) and self._closed is None:
            now = time.monotonic()
            if self.finished != last:
                last, deadline = self.finished, now + timeout_s
            if now >= deadline:
                raise CommTimeout(f"{name} waited on {self.name}: no earlier operation finished "
                                  f"within {timeout_s:g}s")
            self._sleep(deadline - now)

    def _sleep(self, timeout: float | None = None) -> None:
        """``_cv.wait``, counted (the caller holds ``_cv``)."""
        self._waiting += 1
        try:
            self._cv.wait(timeout)
        finally:
            self._waiting -= 1

    def _done(self) -> None:
        with self._lock:
            self._busy = False
            self.finished += 1
            if self._waiting:  # most sync ops: nobody waits, and a notify costs ~0.4 us
                self._cv.notify_all()

    def submit(self, name: str, fn: Callable[[], Any]) -> Work:
        work = Work(name)
        with self._cv:
            if self._closed is not None:
                raise self._closed(name)
            self._queue.append((work, fn))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=f"commrt-{self.name}", daemon=True)
                self._thread.start()
            self._cv.notify_all()
        return work

    def _loop(self) -> None:
        while True:
            with self._cv:
                while (not self._queue or self._busy) and self._closed is None:
                    self._sleep()
                if self._closed is not None:
                    return
                work, fn = self._queue.popleft()
                self._busy = True
            if work._flight is not None:
                work._flight.start()
            try:
                result = fn()
                work._finish(result, None)
            except BaseException as exc:  # handed to the waiter, never lost
                work._finish(None, exc)
            finally:
                self._done()

    def close(self, error: Callable[[str], BaseException] | None = None, timeout_s: float = 5.0) -> bool:
        """Refuse new work, fail queued work with ``error(name)``, and wait (bounded) until the
        running operation (which the caller has cancelled) has given back its turn and the
        worker thread has ended. Returns whether it stopped: only then may the caller close
        the sockets the operations used."""
        error = error or (lambda name: CommError(f"{self.name} is closed; {name} did not run"))
        with self._cv:
            if self._closed is None:
                self._closed = error
            pending = list(self._queue)
            self._queue.clear()
            self._cv.notify_all()
        for work, _ in pending:
            work._finish(None, error(work.name))
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._busy and time.monotonic() < deadline:
                self._sleep(deadline - time.monotonic())
            busy = self._busy
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(max(0.0, deadline - time.monotonic()))
            return not busy and not thread.is_alive()
        return not busy
