"""Replica fault tolerance: how a replica enters a generation (``replica_ft.py``'s ReplicaFT
is a ``Generations``; the module docstring there tells the whole protocol).

``start()`` registers this replica (a group: through its first rank) for a generation, the
leader writes the plan (``replica_vote.lead``), every member opens the generation's world,
replicas without state receive it from the plan's source (broadcasts), and the contributors
redo the step that failed. A generation that fails while forming leads to the next; a replica
left out of one comes back without its state.
"""
from __future__ import annotations

import logging
import os

import msgpack
import torch

from commrt.runtime import bootstrap, world
from commrt.runtime.config import Config
from commrt.runtime.errors import CommError, ConfigError, PeerLost
from commrt.runtime.rendezvous import RendezvousSpec
from commrt.runtime.store import StoreClient
from commrt.train import replica_quorum as q
from commrt.train import replica_state
from commrt.train import replica_vote as rv
from commrt.train.replica_vote import P
from commrt.train.replica_group import ShardedGroup

# ReplicaFT's one logger, whichever of its modules logs (its name as before this module existed)
log = logging.getLogger("commrt.train.replica_ft")


class Generations:
    """Entering generations, for ReplicaFT (which sets the fields below in its ``__init__``).
    A generation that redoes a step averages it with ReplicaFT's ``_average`` and ``_votes``:
    a failed step leads back here (``_enter``), a formed generation back to the step."""
    cfg: Config
    store: StoreClient
    host: str
    port: int
    replica: int
    replicas: int
    shard: int
    group: ShardedGroup | None
    join_timeout_s: float
    vote_timeout_s: float
    incarnation: int
    plan: q.Plan | None  # the generation this replica is in
    t: int
    applied: int
    _alive: int | None

    def start(self) -> int:
        """Join the job: the first generation if it is forming, else the running job (as a
        replica without state). Returns the step to compute first."""
        if self.group is None:
            self.incarnation = self.store.add(rv.incarnation_key(self.replica), 1)
            raw = self.store.mget([P + "cur"])[0]
        else:
            raw = self.group.join(self.cfg, self.host, self.port, self.store, self.join_timeout_s)
            self.incarnation = self.group.incarnation
        if raw is None:
            return self._armed(self._enter(0, self._reg(0, False), end=None))
        cur = int(raw)
        return self._armed(self._enter(cur + 1, self._reg(-1, False), end=cur))

    def _reg(self, applied: int, grad: bool, suspects: tuple[int, ...] = ()) -> q.Registration:
        return q.Registration(self.replica, applied, grad, suspects, self.incarnation)

    def _armed(self, step: int) -> int:
        """The next backward's buckets all-reduce in this generation's world as they fill."""
        self.grads.arm(self.rt.world.backend)
        return step

    def _enter(self, gen: int, reg: q.Registration, end: int | None) -> int:
        """Register for ``gen`` and run it until a step is applied (or, with nothing to redo,
        until the state is in place); a generation that fails leads to the next."""
        previous = self.plan.members if self.plan is not None else tuple(range(self.replicas))
        while True:
            alive, self._alive = self._alive, None  # a hint about the generation that just ended only
            # replaced while frozen: leave before registering or ending a generation (StaleReplica)
            rv.check_current(self.store, self.replica, self.incarnation, f"generation {gen}")
            if self.group is not None:
                self.group.check()  # a group that lost a rank must not register (GroupBroken)
            within, follower = self.join_timeout_s if gen == 0 else self.vote_timeout_s, False
            if self.shard == 0:  # a group registers (and leads) through its first rank
                self.store.set(f"{P}reg/{gen}/{self.replica}", msgpack.packb(reg.pack()))
                if end is not None:
                    rv.end(self.store, end)  # a joiner: the running generation stops at its current step
                if reg.applied >= 0:
                    follower = self.store.add(f"{P}lead/{gen}", 1) > 1
                    if not follower:
                        rv.lead(self.store, gen, self.replicas, previous, within, self.replica, alive)
            plan = rv.plan_of(self.store, gen, within + 2 * self.vote_timeout_s, follower,
                              max(self.join_timeout_s, within + 2 * self.vote_timeout_s), self.replica)
            if plan is None:  # its leader died or froze in lead(): the next generation, without it
                end, gen = None, gen + 1
                continue
            if plan.replicas and plan.replicas != self.replicas:  # its leaders never read this one's registration
                # (or it ignores some of theirs): left out for ever, it would end every generation
                raise ConfigError(f"replica {self.replica}: started for a job of {self.replicas} replicas, but "
                                  f"generation {plan.gen} was formed by a replica of a job of {plan.replicas}; "
                                  "every replica needs the same count (a job does not grow)")
            if not plan.includes(self.replica, self.incarnation):  # left out (too slow): come back without state
                log.warning("replica %d: left out of generation %d (members %s); rejoining",
                            self.replica, gen, list(plan.members))
                self.applied, reg, end, previous, gen = -1, self._reg(-1, False), gen, plan.members, gen + 1
                continue
            self._note(previous if self.plan is not None else plan.members, plan)
            nxt, reg = self._run(plan, reg)
            if nxt is not None:
                return nxt
            previous, end, gen = plan.members, None, gen + 1

    def _note(self, previous: tuple[int, ...], plan: q.Plan) -> None:
        if plan.gen > 0:  # a member back without its state (restarted before the survivors
            # re-formed: on a loaded host, within the same membership) was dropped and rejoined too
            self.counts.drops += len(set(previous) - set(plan.members)) + len(set(previous) & set(plan.fresh))
            self.counts.rejoins += len(set(plan.members) - set(previous)) + len(set(previous) & set(plan.fresh))
        self.counts.generations += 1
        log.info("replica %d: generation %d: replicas %s at step %d (contributors %s, state from %d to %s)",
                 self.replica, plan.gen, list(plan.members), plan.step, list(plan.contributors), plan.source,
                 list(plan.fresh))

    def _run(self, plan: q.Plan, reg: q.Registration) -> tuple[int | None, q.Registration]:
        """Open the generation's world, hand state to replicas without it, redo the step of the
        contributors. (next step, None) on success; (None, registration for the next) if it failed."""
        self._close_world()
        self.plan, self.t = plan, 0
        me = plan.members.index(self.replica)
        try:
            self._open(plan, me)
            if plan.gen == 0 or plan.fresh:
                self._sync(plan)
        except ConfigError:  # not a fault: this replica cannot take part (its model or optimizer differs)
            self._close_world()
            raise
        except CommError as exc:
            log.warning("replica %d: generation %d failed while forming: %s", self.replica, plan.gen, exc)
            rv.end(self.store, plan.gen)
            if plan.gen == 0:  # the first state is the source's (intact: it only sends); the others'
                # was never, or only partly, replaced by it. Registering as none left no leader
                self.applied = plan.step if self.replica == plan.source else -1
            return None, self._registration(plan, reg.grad, exc)
        self.applied = plan.step
        if not plan.contributors:
            # a group's ranks must leave a generation alike (their next collectives are the
            # group's): a vote tells every rank whether some rank failed to form it
            if self.group is not None and not self._votes(True):
                return None, self._registration(plan, reg.grad, None)
            return plan.step, reg
        self.counts.redone_steps += 1
        mine = self.replica in plan.contributors
        return self._average(plan.contributors, mine)

    def _registration(self, plan: q.Plan, grad: bool, exc: Exception | None) -> q.Registration:
        suspects = ()
        if isinstance(exc, PeerLost) and 0 <= exc.rank < len(plan.members):
            suspects = (plan.members[exc.rank],)
        return self._reg(self.applied, grad and self.applied >= 0, suspects)

    def _open(self, plan: q.Plan, me: int) -> None:
        spec = RendezvousSpec(self.host, self.port, me, len(plan.members))
        env = {k: v for k, v in os.environ.items() if k != "LOCAL_WORLD_SIZE"}
        where = f"{P}g{plan.gen}/" + (f"s{self.shard}/" if self.group is not None else "")  # a world per shard index
        self.rt = bootstrap.init_world(self.cfg, spec, env, store=(self.store, None), namespace=where)
        world.install(self.rt)

    def _sync(self, plan: q.Plan) -> None:
        """The source's parameters, buffers and optimizer state to every member (broadcasts)."""
        src = plan.members.index(plan.source)
        desc = self._description(plan.source, src)
        if self.replica != plan.source:  # before any broadcast: a mismatch would fail in every generation
            replica_state.check(self.model, self.optimizer, desc)
        tensors, state = replica_state.tensors(self.model, self.optimizer, desc)
        backend = self.rt.world.backend
        with torch.no_grad():  # a few large broadcasts (per dtype, bounded), not one per tensor
            replica_state.transfer(lambda flat: backend.broadcast(flat, src, False), tensors,
                                   self.replica == plan.source)
        if self.replica != plan.source:
            replica_state.load(self.optimizer, desc, state)
        if self.group is not None:
            self.group.load_from_model()

    def _description(self, source: int, src: int) -> dict:
        """The source's state description (msgpack), broadcast: its size grows with the count of
        tensors, past what a store value holds (1 MiB, some 15,000 tensors with Adam's state)."""
        backend = self.rt.world.backend
        raw = replica_state.pack(replica_state.describe(self.optimizer, self.model)) if self.replica == source else b""
        size = torch.tensor([len(raw)], dtype=torch.int64)
        backend.broadcast(size, src, False)
        buf = (torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw
               else torch.empty(int(size[0]), dtype=torch.uint8))
        backend.broadcast(buf, src, False)
        return replica_state.unpack(buf.numpy().tobytes())

    def _close_world(self) -> None:
        if self.rt is not None:
            world.install(self._outer)
            bootstrap.shutdown(self.rt)
            self.rt = None
