"""The engine's queue of collectives in flight, each with the named step that finishes it.

A gradient reduction is not finished when its collective is: its result still has to land in
the unit's gradient (or, for hybrid sharding, start the cross-replica all-reduce first). Each
queued ``Followup`` names that step as a method of the engine's ``Zero`` and its arguments, so
a gradient can be followed from the hook to the optimizer shard by reading method names.
"""
from __future__ import annotations

import time
from typing import Any, Callable

from commrt.train.breakdown import StepClock


class Followup:
    """A collective in flight (a Work, or a comm stream's Streamed) and what its completion
    means: ``then(*args)``, a named method such as ``Zero.grad_all_reduced``."""
    __slots__ = ("work", "then", "args", "issued_at", "done_at")

    def __init__(self, work: Any, then: Callable[..., None], args: tuple = (), issued_at: float = 0.0):
        self.work, self.then, self.args, self.issued_at = work, then, args, issued_at
        self.done_at: float | None = None
        if issued_at and hasattr(work, "add_done_callback"):  # when it finished, for comm_hidden
            work.add_done_callback(self._stamp)

    def _stamp(self, _work) -> None:
        self.done_at = time.perf_counter()

    def finish(self, clock: StepClock | None = None) -> None:
        if clock is None:
            self.work.wait()  # raises the collective's error, if it failed
            self.then(*self.args)
            return
        clock.hidden(self.issued_at, time.perf_counter(), self.done_at)
        with clock.span("comm_waited"):
            self.work.wait()
        with clock.span("bookkeeping"):
            self.then(*self.args)


def run_ready(queue: list[Followup], clock: StepClock | None = None) -> int:
    """Finish the followups at the front of ``queue`` whose work is done (a ``then`` may append
    more); stops at the first one still in flight. Returns how many ran."""
    ran = 0
    while queue and queue[0].work.is_completed():
        queue.pop(0).finish(clock)
        ran += 1
    return ran


def run_all(queue: list[Followup], clock: StepClock | None = None) -> None:
    """Wait for every followup in order, including those their ``then`` appends."""
    while queue:
        queue.pop(0).finish(clock)
