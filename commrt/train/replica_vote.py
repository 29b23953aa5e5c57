"""Replica fault tolerance, the store's side of the decisions (issue 33 item 2): the per-step
vote, ending a generation, and the leader's plan of the next one. The rules (what a counter value
means, who is in the plan) are replica_quorum.py's pure functions; this module only talks to the
store, with a deadline on every wait.
"""
from __future__ import annotations

import logging
import time

import msgpack

from commrt.runtime.errors import CommError, RendezvousError
from commrt.runtime.store import wait_for
from commrt.runtime.store_core import ABORT, OK
from commrt.train import replica_quorum as q

log = logging.getLogger(__name__)
P = "ft/"  # the store's keys for replica fault tolerance


class StaleReplica(CommError):
    """This process was replaced: a newer start of the same replica (its supervisor took it for
    dead while it was frozen) has joined; it must leave, not take part beside it."""


class JobFinished(RendezvousError):
    """Every member of the job's last generation has left (``ReplicaFT.close()``): no replica
    holds the training state any more, so no generation can form again. A replica (re)started
    then is told so at once (as torchelastic's RendezvousClosedError), not after its join timeout."""


FINISHED = P + "finished"  # set by the last member of the last generation to leave: msgpack [gen, step]


def incarnation_key(replica: int) -> str:
    """The counter of a replica's starts (a group's: set by its first rank)."""
    return f"{P}inc/{replica}"


def check_current(store, replica: int, incarnation: int, where: str) -> None:
    """``StaleReplica`` if a newer start of ``replica`` exists, ``JobFinished`` if the job's
    replicas have all left (one store read)."""
    raw, finished = store.mget([incarnation_key(replica), FINISHED])
    if finished is not None:
        gen, step = msgpack.unpackb(finished)
        raise JobFinished(f"replica {replica} ({where}): the job's replicas finished at step {step} (generation "
                          f"{gen}) and left before this replica rejoined; there is no running job to join")
    current = None if raw is None else int(raw)
    if q.stale(incarnation, current):
        raise StaleReplica(f"replica {replica} ({where}): this process (start {incarnation}) was replaced by start "
                           f"{current} of the same replica while it was not answering; it leaves")


def vote(store, gen: int, target: int, voters: int, ok: bool, vote_timeout_s: float,
         timeout_s: float) -> tuple[bool, int | None]:
    """Whether the step whose votes end at ``target`` (``voters`` per step) commits, as
    generation ``gen``'s vote counter decides: a completed all-reduce adds 1 and waits for the
    rest (one store request); a failed one (or a vote wait that timed out) ends the generation. Also, when the wait
    timed out, how many had voted: they are alive, the others most likely not (``lead``)."""
    key, result, voted = f"{P}v/{gen}", q.UNKNOWN, None
    if ok:
        # one round trip: the add, and the wait for the rest when it was not the last vote
        status, value, added = store.add_wait_count(key, 1, target, None, vote_timeout_s)
        result = q.own_vote(added, target)
        if result == q.UNKNOWN:  # not every vote was in at our add
            if status == OK:
                result = q.outcome(value, target)
            else:
                voted, result = value - (target - voters), end(store, gen, target)
    else:
        result = end(store, gen, target)
    if result == q.UNKNOWN:
        raw = wait_for(store, [f"{P}dec/{gen}"], timeout_s, "the vote's outcome")[0]
        result = q.COMMIT if q.committed(int(raw), target) else q.ABORT
    return result == q.COMMIT, voted


def end(store, gen: int, target: int = 0) -> str:
    """Stop generation ``gen`` at its current step (add BIG); the first to do so records how
    many votes came before it. Returns what that says of the step with ``target``."""
    value = store.add(f"{P}v/{gen}", q.BIG)
    k = q.first_big(value)
    if k is None:
        return q.UNKNOWN
    store.set(f"{P}dec/{gen}", str(k).encode())
    return q.COMMIT if target and q.committed(k, target) else q.ABORT


def leave(store, gen: int, members: int, step: int) -> int:
    """Count this rank out of generation ``gen`` (of ``members`` ranks); the last one to leave
    marks the job finished and ends the wait of any replica registered for ``gen + 1`` (its
    ``skip``): nobody with state is left to write that plan. One rank leaving early is not the
    job's end: the others form ``gen + 1`` without it and leave from there. Returns the count."""
    count = store.add(f"{P}left/{gen}", 1)
    if count == members:
        store.set(FINISHED, msgpack.packb([gen, step]))
        store.set(f"{P}skip/{gen + 1}", b"the job finished")
    return count


def plan_of(store, gen: int, leader_s: float, follower: bool, timeout_s: float, me: int) -> q.Plan | None:
    """Generation ``gen``'s plan; None when its leader died or froze before writing it: then
    every member goes on to ``gen + 1`` together (``skip/<gen>``; a late plan of ``gen`` is not
    used by those who skipped, and those who took it fail to form it and follow). A ``follower``
    (registered with state after the leader had begun) declares the leader lost after
    ``leader_s`` (its own deadline, with room); the others wait up to ``timeout_s`` for either."""
    key, skip = f"{P}mem/{gen}", f"{P}skip/{gen}"
    status, value = store.wait([key], skip, leader_s if follower else timeout_s)
    if status == OK:
        return q.Plan.unpack(msgpack.unpackb(value[0]))
    if status != ABORT:
        if not follower:
            raise RendezvousError(f"replica {me}: the plan of generation {gen} still missing after {timeout_s:g}s")
        late = store.mget([key])[0]
        if late is not None:
            return q.Plan.unpack(msgpack.unpackb(late))
        log.warning("replica %d: generation %d has no plan after %gs: its leader died or stopped answering; "
                    "the members go on to generation %d", me, gen, leader_s, gen + 1)
        store.set(skip, b"the leader is lost")
    return None


def lead(store, gen: int, replicas: int, previous: tuple[int, ...], within_s: float, me: int,
         alive: int | None = None) -> None:
    """Wait for the previous members (those not named lost) to register, then write the plan.
    ``alive``: the previous generation ended because its last vote timed out on the leader, and
    that many members had voted: once that many have registered, the rest (silent for the whole
    vote timeout after their all-reduce completed) are not waited for. A live one left out
    rejoins (without its gradient of that step)."""
    keys = [f"{P}reg/{gen}/{r}" for r in range(replicas)] + [incarnation_key(r) for r in range(replicas)]
    deadline = time.monotonic() + within_s
    while True:
        raw = store.mget(keys)  # registrations and starts read together: a replaced one's is left out
        currents = {r: int(v) for r, v in enumerate(raw[replicas:]) if v is not None}
        regs = q.current_only({r: q.Registration.unpack(msgpack.unpackb(v))
                               for r, v in enumerate(raw[:replicas]) if v is not None}, currents)
        missing = q.awaited(previous, regs)
        enough = alive is not None and len(set(previous) & set(regs)) >= max(alive, 1)
        if not missing or enough or time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    if missing:
        log.warning("replica %d (leader): generation %d forms without %s (not registered within %gs)",
                    me, gen, sorted(missing), within_s)
    plan = q.plan(gen, regs, replicas)
    store.set(f"{P}mem/{gen}", msgpack.packb(plan.pack()))
    store.set(P + "cur", str(gen).encode())
