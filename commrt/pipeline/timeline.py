"""Per-rank timelines of a pipeline step and the bubble they measure (pure: no processes).

The runtime records one event per action it executes: computations (``F``, ``B``, PipeDream's
``U``) and the time spent waiting in receives (``R``). The bubble of a rank is the part of the
step's wall time it did not compute; the theory for GPipe and 1F1B with equal stages is
``(p - 1) / (m + p - 1)`` (Huang et al. 2019; Narayanan et al. 2021), interleaving over ``v``
stages per rank divides the warm-up by ``v``: ``(p - 1) / (v m + p - 1)``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple

BUSY = ("F", "B", "I", "W", "U")
WAIT = "R"


class Event(NamedTuple):
    kind: str  # F, B, U, or R (a receive's wait)
    stage: int
    mb: int
    start: float  # seconds since the step started
    end: float


@dataclass
class Timeline:
    """One rank's events of its last step."""
    started: float = field(default_factory=time.perf_counter)
    events: list[Event] = field(default_factory=list)
    ended: float | None = None

    def add(self, kind: str, stage: int, mb: int, t0: float, t1: float) -> None:
        self.events.append(Event(kind, stage, mb, t0 - self.started, t1 - self.started))

    def finish(self) -> None:
        self.ended = time.perf_counter()

    @property
    def wall(self) -> float:
        return (self.ended if self.ended is not None else time.perf_counter()) - self.started

    def busy(self) -> float:
        return sum(e.end - e.start for e in self.events if e.kind in BUSY)

    def waited(self) -> float:
        return sum(e.end - e.start for e in self.events if e.kind == WAIT)

    def own(self) -> float:
        """Seconds neither computing nor waiting in a receive: posting sends, opening messages,
        the schedule's bookkeeping (the runtime's own cost; a receive's wait is the peer's)."""
        return max(0.0, self.wall - self.busy() - self.waited())

    def bubble(self) -> float:
        """The idle fraction of this rank's step."""
        return 1.0 - self.busy() / self.wall if self.wall > 0 else 0.0


def theory_bubble(num_ranks: int, num_microbatches: int, stages_per_rank: int = 1) -> float:
    """The idle fraction of a synchronous schedule with equal stages and no communication cost."""
    p, m, v = num_ranks, num_microbatches, stages_per_rank
    return (p - 1) / (v * m + p - 1)


def gantt(events: list[Event], wall: float, width: int = 72) -> str:
    """One text line for one rank's step: each column is ``wall / width`` seconds, marked with the
    kind that covers most of it ('F', 'B', 'U', 'r' waiting in a receive, '.' anything else)."""
    cover = [dict() for _ in range(width)]
    col = wall / width if wall > 0 else 1.0
    for e in events:
        lo, hi = int(e.start / col), min(width - 1, int(e.end / col))
        for c in range(max(0, lo), hi + 1):
            overlap = min(e.end, (c + 1) * col) - max(e.start, c * col)
            cover[c][e.kind] = cover[c].get(e.kind, 0.0) + max(0.0, overlap)
    out = []
    for c in cover:
        kind = max(c, key=c.get) if c and max(c.values()) > col / 2 else "."
        out.append("r" if kind == WAIT else kind)
    return "".join(out)
