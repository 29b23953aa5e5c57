"""HYBRID_SHARD / MiCS with the link busy across the step boundary (issue 29.3, ``[train.
zero_optimization] overlap_step``), as part of ``zero.Zero``.

Without it a hybrid step is forward (link idle), backward with the replica all-reduces going out
in backward order (the last layers first), a wait for all of them, the optimizer, and the next
forward: on a slow link between nodes the link idles through every forward and the compute
waits for all of the step's bytes. Here (ByteScheduler, P3: what the next forward needs first
crosses first):

- the units forward runs first (``LATE_FRACTION`` of the bytes) hold their
  replica all-reduce back during backward; at its end (``issue_backward``) they are started in
  forward order, behind the units backward already started, so the first unit the next forward
  needs arrives while the later ones still cross;
- ``Engine.step`` only marks every unit's step due (``defer_update``); the next forward's gather
  of a unit (``settle``) waits for that unit's replica all-reduce and steps its shard first, and
  so does the prefetch of the one unit after it (``Engine._use``), whose gather then overlaps
  the unit's compute (without it, 10 Gbit steps took 3-4% longer).

Every rank issues the same collectives in the same order: the held units' all-reduces after the
last reduce-scatter of backward, in the forward order the engine learnt, and behind them, in the
order they were reduced, any unit reduced after a held one (the engine's flush of a unit with an
unused parameter: chained, its all-reduce would start before or after ``issue_backward``'s
depending on each rank's timing). Each unit steps with the step number and optimizer settings of
the ``step()`` that made it due, with ``zero_step.update``'s arithmetic: the values are bit for
bit those of the unoverlapped step. Gradient clipping (a global norm before any unit steps), LAMB (its trust
ratios all-reduce every unit's norms) and the ZeRO++ comm stream keep the unoverlapped step.
"""
from __future__ import annotations

import functools
import time

from commrt.train import zero_step
from commrt.train.followups import Followup, run_all
from commrt.train.stream import Chained
from commrt.train.units import UnitState

LATE_FRACTION = 0.75
"""Of the gradient bytes, the share (the units forward runs first) whose replica all-reduce waits
for the end of backward; the rest (the last layers, whose gradients come first) crosses during
backward. Measured on the emulated 2 x 2 cluster at 200 Mbit (docs/PERFORMANCE.md, issue 29):
0.5 left the next forward waiting behind backward's backlog, 0.9 the link idle in backward;
0.6-0.75 were best (1528-1576 ms a step against 1675 unoverlapped)."""


class Deferring:
    """Mixed into ``Zero``: the held units, the replica all-reduces in flight per unit
    (``UnitState.landing``) and the due steps (``UnitState.step_due``)."""

    def hold_back(self, order: list[UnitState]) -> None:
        """Hold the first units of ``order`` (forward's) up to ``LATE_FRACTION`` of the bytes."""
        if not self.defer:
            return
        total, seen = sum(u.layout.padded for u in order), 0
        self.late = {}
        for rank, u in enumerate(order):
            if seen >= LATE_FRACTION * total:
                break
            self.late[id(u)] = rank
            seen += u.layout.padded

    def _reduce_deferred(self, u: UnitState, name: str, out, flat) -> None:
        """A unit's reduce-scatter, and its replica all-reduce at once (``Chained``) unless it is
        held; neither enters the queue that the end of backward waits for."""
        self.settle_landing(u)  # accumulation: the previous micro-step's sum lands first
        if id(u) in self.late or self.holding:
            # once a held unit is reduced, every later one is held too: a chained one whose
            # reduce-scatter ends after the last held one's would start its replica all-reduce
            # from the executor thread before or after issue_backward's, differently per rank
            self.holding = True
            work = self._issue(name, self._start_reduce_scatter, out, flat, u)
            self._track(work, self.shard_held, u, out)
            return
        work = Chained(name + " + replica all_reduce", self._start_reduce_scatter(out, flat, u),
                       functools.partial(self._start_replica_all_reduce, out))
        u.landing = Followup(work, self.replica_reduced, (u, out), time.perf_counter())

    def shard_held(self, u: UnitState, out) -> None:
        """A held unit's reduce-scatter is done; its replica all-reduce waits for ``issue_backward``."""
        self.held.append((u, out))

    def issue_backward(self) -> None:
        """End of backward: every reduce-scatter finished (the ``Chained`` ones started their
        replica all-reduce in their executor's thread before the next reduce-scatter ran, so
        before this), then the held units' replica all-reduces in forward order."""
        run_all(self.works, self.clock)
        self.fence()
        self.holding = False
        # held units in forward order; those held only for coming after one (not in late) last, in
        # the order they were reduced (the same on every rank; sorted is stable)
        for u, out in sorted(self.held, key=lambda held: self.late.get(id(held[0]), len(self.late))):
            work = self._start_replica_all_reduce(out)
            u.landing = Followup(work, self.replica_reduced, (u, out), time.perf_counter())
        self.held.clear()

    def defer_update(self, step: int, clip_coef: float) -> None:
        """``Engine.step``: each unit steps when it is next gathered (or ``settle_all``)."""
        zero_step.drop_prefetches(self)
        for u in self.units:
            if u.step_due is not None:  # step() again before the unit was gathered: that step first
                self.settle(u)
            u.step_due = (step, clip_coef)
        self.due_spec = self.spec  # the optimizer settings of this step, whatever changes them before settle
        self.deferred_steps += 1

    def settle_landing(self, u: UnitState) -> None:
        if u.landing is not None:
            # kept until it succeeds: a failed all-reduce (a lost peer) raises again at every later
            # settle instead of letting the unit's due step run on a gradient that never arrived
            u.landing.finish(self.clock)
            u.landing = None

    def settle(self, u: UnitState) -> None:
        """Before ``u``'s values are read: its replica all-reduce has landed, its due step taken."""
        self.settle_landing(u)
        if u.step_due is not None:
            step, coef = u.step_due
            u.step_due = None
            with self.clock.span("optimizer"):
                zero_step.step_unit(self, u, step, coef, self.due_spec)
            self.steps_in_forward += 1

    def settle_all(self) -> None:
        """Every collective of the last backward landed and every due step taken (before a
        checkpoint, a consolidation, the next backward)."""
        self.issue_backward()
        for u in self.units:
            self.settle(u)
