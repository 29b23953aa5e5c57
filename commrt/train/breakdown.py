"""Where one training step's time went: compute (forward, backward, optimizer), communication
the compute waited for, communication hidden under compute, and the engine's own bookkeeping
(hooks, flattening, copies, norms, optimizer glue).

``StepClock`` times nested spans exclusively: a span's time excludes the spans opened inside
it, so a backward phase that contains gradient hooks (bookkeeping) which wait on a collective
(comm waited) counts each second once. Phases (forward, backward, optimizer) are the outer
spans; what remains of them after their inner spans is compute. A collective's hidden time is
how long it ran before anybody waited for it: from its issue to its completion or to the start
of the wait, whichever came first; time in which several collectives ran hidden counts once (a
stage-3 prefetch of many units summed their durations to 10x the step), so hidden time is wall
time, at most the step's.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, fields

from commrt import distributed

PHASES = ("forward", "backward", "optimizer")


def trace_sink():
    """Where a StepClock sends its spans: the runtime's Perfetto trace when ``[log] trace_file``
    is set (obs/observer.py), else nowhere."""
    obs = distributed._observer
    return obs.span if obs is not None and obs.events is not None else None


@dataclass
class StepBreakdown:
    """Seconds of one optimizer step (all micro-steps of an accumulation boundary)."""
    forward: float = 0.0        # compute inside the engine's forward (hooks excluded)
    backward: float = 0.0       # compute inside backward (hooks excluded)
    optimizer: float = 0.0      # the update arithmetic
    comm_waited: float = 0.0    # blocked on collectives
    comm_hidden: float = 0.0    # collective time that ran under compute (not part of total)
    bookkeeping: float = 0.0    # hooks, flattening, copies, norms, queue handling
    total: float = 0.0          # wall time of the phases

    def add(self, name: str, seconds: float) -> None:
        setattr(self, name, getattr(self, name) + seconds)

    def as_ms(self) -> dict[str, float]:
        return {k: round(v * 1000, 3) for k, v in asdict(self).items()}

    def __str__(self) -> str:
        ms = self.as_ms()
        return ", ".join(f"{f.name} {ms[f.name]:.1f}" for f in fields(self)) + " (ms)"


class StepClock:
    """The spans of the step in progress; ``finish_step`` hands out the breakdown."""

    def __init__(self, sink=None):
        """``sink(name, start, seconds)``: each span as it closes (the Perfetto trace's track)."""
        self.sink = sink
        self._stack: list[list] = []  # [name, start, time of nested spans]
        self.current = StepBreakdown()
        self.last: StepBreakdown | None = None
        self._hidden_until = 0.0  # where the hidden time counted so far ends

    def enter(self, name: str) -> None:
        self._stack.append([name, time.perf_counter(), 0.0])

    def leave(self) -> None:
        name, start, nested = self._stack.pop()
        took = time.perf_counter() - start
        self.current.add(name, took - nested)
        if self.sink is not None:
            self.sink(name, start, took)
        if self._stack:
            self._stack[-1][2] += took
        else:
            self.current.total += took

    def open(self) -> bool:
        return bool(self._stack)

    def abandon(self) -> None:
        """Drop the step in progress (spans left open by a step that never finished)."""
        if self._stack:
            self._stack.clear()
            self.current = StepBreakdown()

    def span(self, name: str) -> "_Span":
        return _Span(self, name)

    def hidden(self, issued_at: float, waited_at: float, done_at: float | None) -> None:
        """A collective issued at ``issued_at`` whose wait began at ``waited_at`` (done at
        ``done_at`` if known) ran hidden until the earlier of the two."""
        end = waited_at if done_at is None else min(done_at, waited_at)
        start = max(issued_at, self._hidden_until)  # collectives in flight together count once
        if end > start:
            self.current.comm_hidden += end - start
        self._hidden_until = max(self._hidden_until, end)

    def finish_step(self) -> StepBreakdown:
        self.last, self.current = self.current, StepBreakdown()
        return self.last


class _Span:
    """``with clock.span("bookkeeping"):`` (a class, not contextmanager: cheaper per hook)."""
    __slots__ = ("clock", "name")

    def __init__(self, clock: StepClock, name: str):
        self.clock, self.name = clock, name

    def __enter__(self) -> None:
        self.clock.enter(self.name)

    def __exit__(self, *exc) -> None:
        self.clock.leave()
