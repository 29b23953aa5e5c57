"""Replica fault tolerance, the store's side of the decisions (issue 33 item 2): the per-step
vote, ending a generation, and the leader's plan of the next one. The rules (what a counter value
means, who is in the plan) are replica_quorum.py's pure functions; this module only talks to the
store, with a deadline on every wait.
"""
from __future__ import annotations

import logging
import time

import msgpack

from commrt.runtime.store import wait_for
from commrt.runtime.store_core import OK
from commrt.train import replica_quorum as q

log = logging.getLogger(__name__)
P = "ft/"  # the store's keys for replica fault tolerance


def vote(store, gen: int, target: int, ok: bool, vote_timeout_s: float, timeout_s: float) -> bool:
    """Whether the step whose votes end at ``target`` commits, as generation ``gen``'s vote
    counter decides: a completed all-reduce adds 1 and waits for the rest; a failed one (or a
    vote wait that timed out) ends the generation."""
    key, result = f"{P}v/{gen}", q.UNKNOWN
    if ok:
        value = store.add(key, 1)
        result = q.outcome(value, target)
        if result == q.UNKNOWN and value < q.BIG:  # not every vote is in yet
            status, value = store.wait_count(key, target, None, vote_timeout_s)
            result = q.outcome(value, target) if status == OK else end(store, gen, target)
    else:
        result = end(store, gen, target)
    if result == q.UNKNOWN:
        raw = wait_for(store, [f"{P}dec/{gen}"], timeout_s, "the vote's outcome")[0]
        result = q.COMMIT if q.committed(int(raw), target) else q.ABORT
    return result == q.COMMIT


def end(store, gen: int, target: int = 0) -> str:
    """Stop generation ``gen`` at its current step (add BIG); the first to do so records how
    many votes came before it. Returns what that says of the step with ``target``."""
    value = store.add(f"{P}v/{gen}", q.BIG)
    k = q.first_big(value)
    if k is None:
        return q.UNKNOWN
    store.set(f"{P}dec/{gen}", str(k).encode())
    return q.COMMIT if target and q.committed(k, target) else q.ABORT


def lead(store, gen: int, replicas: int, previous: tuple[int, ...], within_s: float, me: int) -> None:
    """Wait for the previous members (those not named lost) to register, then write the plan."""
    keys = [f"{P}reg/{gen}/{r}" for r in range(replicas)]
    deadline = time.monotonic() + within_s
    while True:
        regs = {r: q.Registration.unpack(msgpack.unpackb(v)) for r, v in enumerate(store.mget(keys)) if v is not None}
        missing = q.awaited(previous, regs)
        if not missing or time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    if missing:
        log.warning("replica %d (leader): generation %d forms without %s (not registered within %gs)",
                    me, gen, sorted(missing), within_s)
    plan = q.plan(gen, regs)
    store.set(f"{P}mem/{gen}", msgpack.packb(plan.pack()))
    store.set(P + "cur", str(gen).encode())
