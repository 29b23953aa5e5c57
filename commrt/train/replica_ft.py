"""Replica fault tolerance for data parallel training, ``[train] fault_tolerance = "replica"``
(issue 33 item 2; after TorchFT's per-step quorum).

A replica (a rank of a data-parallel job) that dies or stops answering is dropped at the step
it failed in: the others finish that step with the average over the replicas that contributed
(the divisor is their count), and go on. A replica that (re)starts joins at a step boundary,
receives the current parameters and optimizer state from a live replica over the transport,
and the job is back to full size. Nothing hangs: every wait has a deadline.

How: the replicas of a *generation* (see ``replica_quorum.py``) run an ordinary commrt world of
their own. Each step, ``step()`` all-reduces a copy of the local gradients (they stay in
``p.grad`` until the step commits, so a failed step is redone from them, never applied twice),
then votes through the store; only a committed step is applied. A failed or aborted step ends the
generation: the live replicas register for the next one, a leader writes its plan (members,
contributors of the step, who sends state), they open a new world, replicas without state
receive it, and the step is averaged again among its contributors. On a healthy step the
copy and the all-reduce run from the gradient hooks during backward, in buckets
(``replica_overlap.py``); the vote, the store's decisions, is ``replica_vote.py``; entering a
generation (registration, the generation's world, the state transfer) is ``replica_generation.py``.

A replica may be a group of ranks (``shards`` > 1, HYBRID_SHARD's layout): the group shards the
gradient and the optimizer state inside itself and is dropped and rejoins as a whole
(``replica_group.py``).

The store must outlive the replicas: run it in the launcher (``serve_store``; ``commrt.train.
replica_ft.serve``), not in a replica. If replica 0 serves it (``commrt.apps.train_lm`` without
``COMMRT_FT_STORE``), replica 0's death ends the job. A second failure while the survivors are
forming the next generation (the leader's death before it writes the plan) costs a few vote
timeouts: the others skip that generation and form the next without it (``replica_vote.plan_of``).
"""
from __future__ import annotations

import dataclasses
import logging
import time

import torch

from commrt.obs import stats
from commrt.runtime import world
from commrt.runtime.config import Config, load_config
from commrt.runtime.errors import CommError, ConfigError
from commrt.runtime.store import StoreClient, StoreServer
from commrt.collectives.reduce_ops import ReduceOp
from commrt.train import replica_quorum as q
from commrt.train import replica_vote as rv
from commrt.train.replica_vote import P
from commrt.train.replica_generation import Generations
from commrt.train.replica_group import GroupBroken, ShardedGroup
from commrt.train.replica_overlap import Replicated
from commrt.transport import Transport
from commrt.transport.security import check_bind

log = logging.getLogger(__name__)
PHASES = ("copy", "all_reduce", "vote", "apply")


def serve(cfg: Config, host: str, port: int) -> tuple[Transport, StoreServer]:
    """A store for the replicas, in a process that is not one of them (the launcher's). Like
    every commrt store, not off this host unencrypted unless ``allow_insecure`` (check_bind)."""
    check_bind(cfg, [host])
    transport = Transport(cfg, "ft-store")
    try:
        return transport, StoreServer(transport, host, port)
    except BaseException:  # a port in use: the transport's context and ZAP thread outlived the error
        transport.close()
        raise


def _open_store(transport: Transport, host: str, port: int, serve_store: bool,
                timeout_s: float) -> tuple[StoreServer | None, StoreClient]:
    """The replicas' store (served here when ``serve_store``) and a client of it. A failure
    closes what was opened, ``transport`` included: its zmq context and ZAP thread outlived
    the error in a process that went on, or retried."""
    server = None
    try:
        server = StoreServer(transport, host, port) if serve_store else None
        return server, StoreClient(transport, host, port, timeout_s)
    except BaseException:
        if server is not None:
            server.close()
        transport.close()
        raise


@dataclasses.dataclass
class Counts:
    drops: int = 0
    """Replicas that left a generation (died, timed out, or were left out)."""
    rejoins: int = 0
    """Replicas that joined a running job (after the first generation) and received its state."""
    redone_steps: int = 0
    """Steps whose average was computed again after a failure (none was lost)."""
    generations: int = 0
    time_s: dict = dataclasses.field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    """Seconds spent per phase of ``step()`` (the overhead's breakdown, tests/perf/replica_ft_overhead.py);
    a group's reduce-scatter inside it counts as its "copy"."""


class ReplicaFT(Generations):
    """``start()`` once, then after each backward ``step()``: both return the step to compute
    next (a replica that was left out and came back may skip ahead). ``history`` holds, per
    applied step, the replicas whose gradients it averaged."""

    def __init__(self, model: torch.nn.Module, optimizer, replica: int, replicas: int,
                 store: str, cfg: Config | None = None, timeout_s: float = 30.0, vote_timeout_s: float = 5.0,
                 join_timeout_s: float = 60.0, serve_store: bool = False, shard: int = 0, shards: int = 1,
                 overlap: bool = True):
        """``shards`` > 1: ``replica`` is a group of that many ranks (``shard`` is this rank's
        index in it) sharding gradients and optimizer state (replica_group.py); ``optimizer`` is
        then a callable that makes the optimizer from a list of parameters (this rank's flat slice).
        ``overlap`` (data parallel): all-reduce buckets from the gradient hooks during backward
        (replica_overlap.py); then each step must run exactly one backward (False to accumulate
        gradients over several)."""
        if not (0 <= replica < replicas and 0 <= shard < shards):
            # a replica id outside 0..replicas-1 is never in a plan: it would rejoin, and end the
            # generation it was left out of, for ever (no step would commit again)
            raise ConfigError(f"replica {replica} of {replicas}, shard rank {shard} of {shards}: the replica must be "
                              f"in 0..{replicas - 1} and the shard rank in 0..{shards - 1}")
        self.model, self.replica, self.replicas = model, replica, replicas
        self.shard, self.shards = shard, shards
        self.group = ShardedGroup(model, optimizer, replica, shard, shards) if shards > 1 else None
        self.optimizer = self.group.optimizer if self.group is not None else optimizer
        params = self._trainable = [p for p in model.parameters() if p.requires_grad]
        self.grads = self.group or Replicated(params, optimizer, overlap, timeout_s)
        base = cfg or load_config()
        self.cfg = dataclasses.replace(base, comm=dataclasses.replace(base.comm, timeout_s=timeout_s))
        self.vote_timeout_s, self.join_timeout_s = vote_timeout_s, join_timeout_s
        self.host, port = store.rsplit(":", 1)
        self.port = int(port)
        if serve_store:  # before any socket: as every commrt store, not off the host unencrypted
            check_bind(self.cfg, [self.host])
        self._ctl = Transport(self.cfg, f"replica{replica}-ft")
        self._server, self.store = _open_store(self._ctl, self.host, self.port, serve_store, timeout_s)
        self.rt = None
        self._outer = world.get()  # the default world before ours (commrt bench's): restored on close
        self.plan: q.Plan | None = None
        self.t = 0  # votes cast in this generation
        self.applied = -1
        self.history: list[tuple[int, tuple[int, ...]]] = []
        self.counts = Counts()
        self._alive: int | None = None  # set when this rank's last vote timed out: how many groups had voted
        self.incarnation = 0  # which start of this replica (``start``): a replaced one is refused
        self.closed = False
        global _active
        _active = self

    # -- one step -------------------------------------------------------------------------
    def start(self) -> int:
        self._usable("start")
        return super().start()

    def step(self) -> int:
        """Average this step's gradients over the generation (again among the survivors if it
        fails), apply them with the optimizer, and return the next step."""
        self._usable("step")
        self._check_trainable()
        t0 = time.perf_counter()
        self._group_op(self.grads.prepare)
        self.counts.time_s["copy"] += time.perf_counter() - t0
        nxt, reg = self._average(self.plan.members, True, overlapped=True)
        if nxt is None:
            nxt = self._enter(self.plan.gen + 1, reg, end=None)
        return self._armed(nxt)

    def _average(self, contributors: tuple[int, ...], mine: bool,
                 overlapped: bool = False) -> tuple[int | None, q.Registration | None]:
        """``overlapped``: the step's backward may have all-reduced its buckets already."""
        spent, t0 = self.counts.time_s, time.perf_counter()
        if overlapped and self.grads.overlapped():
            (flat, exc), t1 = self.grads.finish(), t0
        else:
            flat = self.grads.flat(mine)
            t1 = time.perf_counter()
            try:
                self.rt.world.backend.all_reduce(flat, ReduceOp.SUM, False)
                exc = None
            except CommError as e:
                exc = e
        t2 = time.perf_counter()
        ok = self._votes(exc is None)
        t3 = time.perf_counter()
        spent["copy"] += t1 - t0
        spent["all_reduce"] += t2 - t1
        spent["vote"] += t3 - t2
        if not ok:
            if exc is not None:
                log.warning("replica %d: step %d failed in generation %d: %s", self.replica, self.applied,
                            self.plan.gen, exc)
            return None, self._registration(self.plan, mine, exc)
        self._group_op(self.grads.apply, flat, len(contributors) * self.shards)
        spent["apply"] += time.perf_counter() - t3
        self.history.append((self.applied, tuple(contributors)))
        log.info("replica %d: step %d applied, averaged over replicas %s (generation %d)", self.replica,
                 self.applied, list(contributors), self.plan.gen)
        self.applied += 1
        return self.applied, None

    def _usable(self, call: str) -> None:
        """``ConfigError`` for a call out of order (it failed on a None plan or a closed socket)."""
        if self.closed:
            raise ConfigError(f"replica {self.replica}: ReplicaFT.{call}() after close(); make a new ReplicaFT to "
                              "rejoin the job")
        if call == "step" and self.plan is None:
            raise ConfigError(f"replica {self.replica}: ReplicaFT.step() before start(): start() joins the job "
                              "and returns the step to compute first")
        if call == "start" and self.plan is not None:
            raise ConfigError(f"replica {self.replica}: ReplicaFT.start() twice (it is in generation "
                              f"{self.plan.gen} already)")

    def _check_trainable(self) -> None:
        """The parameters that require grad are still those whose gradients are averaged: one
        unfrozen later would be stepped with this replica's own gradient (the replicas would
        drift apart without an error); as the engine, refuse it (every replica, at that step)."""
        now = [p for p in self.model.parameters() if p.requires_grad]
        if len(now) != len(self._trainable) or any(a is not b for a, b in zip(now, self._trainable)):
            raise ConfigError(f"replica {self.replica}: the parameters that require grad changed after ReplicaFT was "
                              f"made ({len(self._trainable)} then, {len(now)} now): their gradients would not be "
                              "averaged; set requires_grad before ReplicaFT is made")

    def _votes(self, ok: bool) -> bool:
        """The generation's next vote; every rank of every member group votes, so all shards
        commit (or abort) the same steps."""
        per_step = len(self.plan.members) * self.shards
        self.t += 1
        ok, voted = rv.vote(self.store, self.plan.gen, per_step * self.t, per_step, ok, self.vote_timeout_s,
                            self.cfg.comm.timeout_s)
        # groups that voted, at least (a group's ranks may not all have): the leader waits for them only
        self._alive = None if voted is None else -(-voted // self.shards)
        return ok

    def _group_op(self, fn, *args):
        try:
            return fn(*args)
        except GroupBroken:
            rv.end(self.store, self.plan.gen)  # the other groups stop waiting for this one's votes
            raise

    # -- the end --------------------------------------------------------------------------

    def close(self) -> None:
        """Leave: close this generation's world and count this rank out of it (the last member
        to leave marks the job finished: ``replica_vote.leave``); a replica that serves the
        store waits (briefly) until the others have left, so none sees its store vanish mid-vote.
        Twice: nothing more."""
        global _active
        if self.closed:
            return
        self.closed = True
        if isinstance(self.grads, Replicated) and self.grads.overlap is not None:
            self.grads.overlap.disarm()  # a backward after close must not all-reduce on the closed world
        plan = self.plan
        self._close_world()
        if self.group is not None:
            self.group.close()
        if plan is not None:  # one that never joined a generation is in none to leave
            members = len(plan.members) * self.shards
            try:
                rv.leave(self.store, plan.gen, members, self.applied)
                if self._server is not None:
                    self.store.wait_count(f"{P}left/{plan.gen}", members, None, self.vote_timeout_s)
            except CommError as exc:
                log.warning("replica %d: leaving: %s", self.replica, exc)
        self.store.close()
        if self._server is not None:
            self._server.close()
        self._ctl.close()
        if _active is self:
            _active = None

    def stats(self) -> dict:
        return {"generation": self.plan.gen if self.plan else -1,
                "members": list(self.plan.members) if self.plan else [],
                **dataclasses.asdict(self.counts)}


_active: ReplicaFT | None = None  # for comm_stats()["replica_ft"], as quant registers its section


def _stats():
    return _active.stats() if _active is not None else None


stats.register("replica_ft", _stats)
