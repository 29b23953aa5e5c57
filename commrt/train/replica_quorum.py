"""Replica fault tolerance, the decisions: which steps a generation committed, and who is in the
next one (issue 33 item 2). Pure functions over what the store returned, tested without sockets;
``replica_ft.py`` does the talking.

A *generation* is one fixed set of replicas with its own commrt world. Each generation has one
vote counter in the store. After a step's gradient all-reduce, each member adds 1 if the
all-reduce completed on it; a member whose all-reduce failed (a peer lost), whose vote wait
timed out, or a replica that wants to join adds ``BIG`` instead, which ends the generation. The
store serialises the adds, so the counter's history decides, once, for everyone: step ``t`` of
the generation commits if and only if the counter reached ``n * (t + 1)`` (all ``n`` members'
votes for steps ``0..t``) before the first ``BIG``. Completion of a collective is not atomic (a
replica killed mid-all-reduce may have sent its part to one survivor and not another), which is
why a completed all-reduce alone decides nothing: a step is applied only once the store says so.
The first ``BIG`` adder learns from its add's result how many unit votes came before it
(``k_first``) and writes that down, for those whose answer came after it.
"""
from __future__ import annotations

from dataclasses import dataclass

BIG = 1 << 40  # larger than any count of unit votes in a generation (2^40 steps x replicas)
COMMIT, ABORT, UNKNOWN = "commit", "abort", "unknown"


def outcome(value: int, target: int) -> str:
    """What a counter value read at or after the step's votes says about the step whose votes
    end at ``target`` (= members x (steps so far + 1)): COMMIT when all unit votes are in and no
    BIG; ABORT when a BIG came before the last unit vote; UNKNOWN when both are in and only
    ``k_first`` tells the order (or, below ``target`` with no BIG, nothing is decided yet)."""
    bigs, units = divmod(value, BIG)
    if bigs == 0:
        return COMMIT if units >= target else UNKNOWN
    return ABORT if units < target else UNKNOWN


def own_vote(added: int, target: int) -> str:
    """What the counter right after this replica's own vote for the step with ``target`` says:
    a vote that came after the generation's end (a BIG) means ABORT, whatever came later, since
    the step needed every vote, this one included, before the first BIG (no replica votes for
    the next step before this one commits). Needs no ``k_first``: an ender that died before
    writing it leaves this voter an answer."""
    return ABORT if added >= BIG else outcome(added, target)


def first_big(after_add: int) -> int | None:
    """``k_first`` if the add of BIG that returned ``after_add`` was the generation's first
    (the unit votes before it), else None: an earlier one has written it."""
    return after_add - BIG if after_add < 2 * BIG else None


def committed(k_first: int, target: int) -> bool:
    """Given the unit votes that came before the first BIG, whether the step with ``target`` committed."""
    return k_first >= target


@dataclass(frozen=True)
class Registration:
    """What a replica tells the next generation's leader about itself."""
    replica: int
    applied: int
    """Optimizer steps its state has applied (the step it averages next); -1: no state (a
    replica that (re)started, or one that was left out and dropped its state)."""
    grad: bool
    """It holds its own gradient of step ``applied`` (to be averaged in the new generation)."""
    suspects: tuple[int, ...] = ()
    """Replicas its failed collective named as lost: the leader does not wait for them."""
    incarnation: int = 0
    """Which start of the replica registers (``stale``): a process that was replaced while it
    was frozen must not take part beside its replacement under the same replica id."""

    def pack(self) -> dict:
        return {"replica": self.replica, "applied": self.applied, "grad": self.grad, "suspects": list(self.suspects),
                "incarnation": self.incarnation}

    @classmethod
    def unpack(cls, raw: dict) -> "Registration":
        return cls(int(raw["replica"]), int(raw["applied"]), bool(raw["grad"]), tuple(int(s) for s in raw["suspects"]),
                   int(raw.get("incarnation", 0)))


@dataclass(frozen=True)
class Plan:
    """Generation ``gen``: its members (replica ids, ascending: a member's rank in the
    generation's world is its index), the step they all stand at, which of them contribute a
    gradient of that step (the divisor of its average), and the member whose state the others
    without state receive."""
    gen: int
    members: tuple[int, ...]
    step: int
    contributors: tuple[int, ...]
    source: int
    fresh: tuple[int, ...]
    incarnations: tuple[int, ...] = ()
    """Per member, the incarnation that registered: only that process takes the member's place."""
    replicas: int = 0
    """The job's count of replicas, as its leader was started with (0: not recorded)."""

    def pack(self) -> dict:
        return {"gen": self.gen, "members": list(self.members), "step": self.step,
                "contributors": list(self.contributors), "source": self.source, "fresh": list(self.fresh),
                "incarnations": list(self.incarnations), "replicas": self.replicas}

    @classmethod
    def unpack(cls, raw: dict) -> "Plan":
        return cls(int(raw["gen"]), tuple(raw["members"]), int(raw["step"]), tuple(raw["contributors"]),
                   int(raw["source"]), tuple(raw["fresh"]), tuple(raw.get("incarnations", ())),
                   int(raw.get("replicas", 0)))

    def includes(self, replica: int, incarnation: int) -> bool:
        """Whether this start of ``replica`` is a member (an earlier or later start is not)."""
        if replica not in self.members:
            return False
        return not self.incarnations or self.incarnations[self.members.index(replica)] == incarnation


def awaited(previous: tuple[int, ...], regs: dict[int, Registration]) -> set[int]:
    """The previous generation's members the leader still waits for: not registered, and not
    named lost by a member that did register."""
    suspects = {s for r in regs.values() for s in r.suspects}
    return {m for m in previous if m not in regs and m not in suspects}


def stale(incarnation: int, current: int | None) -> bool:
    """Whether a replica's start ``incarnation`` has been replaced: ``current`` is the newest
    start's (the store's counter; None before any)."""
    return current is not None and current > incarnation


def current_only(regs: dict[int, Registration], currents: dict[int, int | None]) -> dict[int, Registration]:
    """The registrations of replicas' newest starts: a frozen process that wakes after it was
    replaced registers under the same key as its replacement, possibly after it."""
    return {r: reg for r, reg in regs.items() if not stale(reg.incarnation, currents.get(r))}


def plan(gen: int, regs: dict[int, Registration], replicas: int = 0) -> Plan:
    """The next generation from the registrations the leader saw. Every replica with state
    stands at the same step (steps are applied only when committed, by all members alike);
    a disagreement is a bug, not a fault to survive."""
    with_state = sorted(r for r, reg in regs.items() if reg.applied >= 0)
    if not with_state:
        raise RuntimeError(f"generation {gen}: no registered replica holds the training state "
                           f"(registered: {sorted(regs)}); the job cannot continue")
    steps = {regs[r].applied for r in with_state}
    if len(steps) != 1:
        raise RuntimeError(f"generation {gen}: replicas with state disagree on the step: "
                           f"{ {r: regs[r].applied for r in with_state} }")
    members = tuple(sorted(regs))
    return Plan(gen, members, steps.pop(), tuple(r for r in with_state if regs[r].grad),
                with_state[0], tuple(sorted(r for r in regs if regs[r].applied < 0)),
                tuple(regs[r].incarnation for r in members), replicas)
