"""The comm stream of ZeRO++: one thread that issues a training engine's collectives in the
order they were submitted, like one CUDA stream of NCCL calls.

A quantized collective is a composition (encode, exchange, decode, node-local hops) that runs to
the end in the thread that calls it. Run from the training hooks it would block compute; run
from a thread of its own it overlaps compute, as the exact stage-3 prefetch and the gradient
reduce-scatters do. The hooks submit in the same order on every rank, so each group still sees
its collectives in one order everywhere, as long as every collective on those groups goes
through the stream until ``fence`` returns.
"""
from __future__ import annotations

from typing import Callable

from commrt.runtime.work import Executor, Work


class Streamed:
    """A collective submitted to the stream: done when the stream has issued it and the
    collective it started (a Work, or None for one that ran to the end there) has finished."""

    def __init__(self, issued):
        self.issued = issued

    def is_completed(self) -> bool:
        inner = self.issued._result if self.issued.is_completed() else None
        return self.issued.is_completed() and (inner is None or inner.is_completed())

    def wait(self) -> None:
        inner = self.issued.result()
        if inner is not None:
            inner.wait()


class CommStream:
    def __init__(self, name: str = "zero-stream"):
        self._executor = Executor(name)

    def submit(self, name: str, start: Callable) -> Streamed:
        """Run ``start()`` (which starts a collective and returns its Work, or runs one to the
        end and returns None or a finished Work) on the stream, after everything submitted."""
        return Streamed(self._executor.submit(name, start))

    def fence(self) -> None:
        """Return once the stream has issued everything submitted so far: then the caller may
        use the same groups directly without changing their order on any rank."""
        self._executor.submit("fence", _nothing).wait()

    def close(self) -> None:
        self._executor.close()


def _nothing() -> None:
    """A fence's operation: done once everything before it on the stream has been issued."""


class Chained(Work):
    """A collective (``first``, a Work) and the one ``then()`` starts once it has succeeded,
    started in the thread that finished ``first`` (its group's executor): HYBRID_SHARD's replica
    all-reduce follows its unit's reduce-scatter at once, instead of when the training thread
    next looks (a gradient hook, up to one module's backward later: 4.7 ms per unit on average,
    measured), so neither the replica peer waits for this rank's compute nor the end of backward
    for a chain of hops. Done when the second is done; ``wait`` raises either one's error.

    Order: ``first``s of one group finish in issue order, so their callbacks start the second
    collectives in issue order on every rank (a first already finished when chained starts its
    second here, before the caller can issue anything later). A backend whose works finish
    only when asked (gloo's) finishes them in the training thread that polls or waits, in its
    program order, the same on every rank."""

    def __init__(self, name: str, first: Work, then: Callable[[], Work | None]):
        super().__init__(name)
        self._then, self._first, self._second = then, first, None
        first.add_done_callback(self._first_done)

    # A Work that learns of its completion only when asked (gloo's, commrt/integrations/
    # torch_backend.TorchWork) runs its callbacks in the thread that asks: polling or waiting on
    # the chain asks both halves, or the second would never start and a wait would never end.
    def is_completed(self) -> bool:
        if not self._done.is_set():
            self._first.is_completed()
            if self._second is not None:
                self._second.is_completed()
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        if not self._done.is_set():
            self._first.wait(timeout)  # raises the first's error, as the chain would
            if self._second is not None:
                self._second.wait(timeout)
        return super().wait(timeout)

    def _first_done(self, first: Work) -> None:
        if first.exception() is not None:
            self._finish(None, first.exception())
            return
        try:
            second = self._then()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter, who raises it
            self._finish(None, exc)
            return
        if second is None:
            self._finish(None, None)
        else:
            self._second = second
            second.add_done_callback(lambda w: self._finish(None, w.exception()))
