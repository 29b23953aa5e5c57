"""Workers that join a running parameter-server job (issue 33 item 3), without sockets: two (or
three) ``ServerCore`` shards and simulated workers whose requests reach the shards in random
orders. The rule under test is in commrt/ps/membership.py: the initial members are never late
whatever the arrival order; a late or dropped worker is admitted at the same step on every shard
and its pushes are never refused."""
from __future__ import annotations

import random

import numpy as np
import pytest

from commrt.optim import rules as optim
from commrt.ps import protocol as P
from commrt.ps.core import ServerCore
from commrt.ps.membership import starting_step
from commrt.ps.state import ShardState
from commrt.runtime.config import PsConfig
from commrt.runtime.errors import ConfigError

SEGS = [[["w", 0, 4, 1]], [["w", 4, 6, 1]]]  # shard k holds SEGS[k] of one 6-element tensor
CUTS = {2: SEGS, 3: [[["w", 0, 2, 1]], [["w", 2, 4, 1]], [["w", 4, 6, 1]]]}
SHAPES = [["w", [6]]]
VALUES = np.arange(6, dtype=np.float32)


def _shards(n: int, workers: int, mode: str, **kw) -> list[ServerCore]:
    cfg = PsConfig(servers=tuple(f"tcp://127.0.0.1:{k + 1}" for k in range(n)), workers=workers, mode=mode,
                   lr=0.1, **kw)
    return [ServerCore(cfg, k, ShardState(optim.OptimSpec("sgd", lr=0.1), workers)) for k in range(n)]


class Worker:
    """One simulated PSClient: a script of calls, each one request per shard, the next call only
    once every shard answered (as PSClient does); a reply may come from any later handle()."""

    def __init__(self, w: int, shards: int, steps: int, late: bool = False):
        self.w, self.n, self.steps, self.late = w, shards, steps, late
        self.segs = CUTS.get(shards, SEGS)
        self.step, self.call, self.outbox, self.answers = 0, None, {}, {}
        self.init_bodies: list = []
        self.done = False
        self._next("init")

    def _next(self, call: str) -> None:
        self.call, self.answers = call, {}
        op = {"init": P.INIT, "join": P.JOIN, "pull": P.PULL, "push": P.PUSHPULL}[call]
        self.outbox = {}
        for k in range(self.n):
            segs = self.segs[k]
            ids = list(range(len(segs)))
            if op == P.INIT:
                body, frames = [self.w == 0, segs, SHAPES], ([VALUES[s:e].tobytes() for _, s, e, _ in segs]
                                                             if self.w == 0 else [])
            elif op == P.JOIN:
                body, frames = [], []
            else:
                body = ids
                frames = [np.full(e - s, 0.01 * (self.w + 1), np.float32).tobytes()
                          for _, s, e, _ in segs] if op == P.PUSHPULL else []
            self.outbox[k] = [P.encode_request(op, self.w, self.step, 1, body), *frames]

    def receive(self, k: int, reply: P.Reply) -> None:
        assert reply.status in (P.OK, P.DUPLICATE), (self.w, self.call, k, reply)
        self.answers[k] = reply.body
        if len(self.answers) < self.n:
            return
        bodies = [self.answers[k] for k in range(self.n)]
        if self.call == "init":
            self.init_bodies = bodies
            join, self.step = starting_step(bodies)
            return self._next("join" if join else "pull")
        if self.call == "join":
            assert {b[1] for b in bodies} == {self.step}, (self.w, bodies)  # every shard agrees
            return self._next("pull")
        if self.call == "push":
            self.step += 1
        if self.step >= self.steps:
            self.done = True
        else:
            self._next("push")


def _simulate(seed: int, shards: list[ServerCore], workers: list[Worker], late_after: int) -> int:
    """Deliver one pending request to one shard at a time, in a random order; the late workers
    start once the others have made ``late_after`` deliveries (or nothing else can move).
    Returns the deliveries made."""
    rng, sent, idents = random.Random(seed), 0, {w.w: f"w{w.w}".encode() for w in workers}
    while not all(w.done for w in workers):
        ready = [(w, k) for w in workers if not w.done and (not w.late or sent >= late_after) for k in w.outbox]
        if not ready:  # only the late ones can move: they start now
            ready = [(w, k) for w in workers if not w.done for k in w.outbox]
        assert ready, ("deadlock", [(w.w, w.call, w.step, sorted(w.answers)) for w in workers])
        w, k = rng.choice(ready)
        frames = w.outbox.pop(k)
        sent += 1
        for out in shards[k].handle(idents[w.w], frames, 0.0):
            target = next(v for v in workers if idents[v.w] == out.ident)
            target.receive(k, P.decode_reply(out.frames[0]))
    return sent


@pytest.mark.parametrize("mode,staleness", [("async", 0), ("ssp", 0), ("ssp", 1), ("ssp", 2)])
@pytest.mark.parametrize("n_shards", [2, 3])
def test_every_interleaving_admits_a_late_worker_at_one_step_and_never_delays_a_member(mode, staleness, n_shards):
    for seed in range(60):
        shards = _shards(n_shards, 3, mode, staleness=staleness, initial_workers=2)
        workers = [Worker(0, n_shards, 8), Worker(1, n_shards, 8), Worker(2, n_shards, 8, late=True)]
        _simulate(seed, shards, workers, late_after=seed % 25)
        for m in workers[:2]:  # the initial members: members everywhere, from step 0, whatever the order
            assert all(b[2] and b[1] == 0 for b in m.init_bodies), (seed, m.init_bodies)
        late = workers[2]
        assert late.init_bodies and not all(b[2] for b in late.init_bodies), (seed, late.init_bodies)
        start = max(b[3] for b in late.init_bodies)
        for core in shards:
            st = core.state
            assert st.clocks == [8, 8, 8] and not st.late and not st.dropped, (seed, st.clocks)
            # every push applied once: 8 of each member, and the late worker's from its start on
            assert st.version == 16 + 8 - start and core.counters["rejected"] == 0, (seed, core.stats())
            if mode == "ssp":
                assert max(st.staleness) <= staleness, (seed, st.staleness)


def test_an_initial_member_started_last_is_waited_for_and_starts_at_zero():
    """Not 'late': in SSP the others stop at the bound until it comes, on every shard."""
    shards = _shards(2, 3, "ssp", staleness=1)
    workers = [Worker(0, 2, 6), Worker(1, 2, 6), Worker(2, 2, 6, late=True)]
    _simulate(3, shards, workers, late_after=200)  # starts once nothing else can move
    assert all(b[2] and b[1] == 0 for b in workers[2].init_bodies)
    assert all(max(c.state.staleness) <= 1 and c.state.version == 18 for c in shards)


def _reply(out):
    return P.decode_reply(out[0].frames[0])


def test_a_dropped_worker_rejoins_at_the_running_step_and_a_resumed_shard_remembers(tmp_path):
    shards = _shards(1, 2, "ssp", staleness=1, worker_timeout_s=1.0, on_worker_loss="continue",
                     checkpoint_dir=str(tmp_path), checkpoint_every=1000)
    core = shards[0]
    assert _reply(core.handle(b"a", [P.encode_request(P.INIT, 0, 0, 1, [True, SEGS[0], SHAPES]),
                                      VALUES[:4].tobytes()], 0.0)).status == P.OK
    assert _reply(core.handle(b"b", [P.encode_request(P.INIT, 1, 0, 1, [False, SEGS[0], SHAPES])], 0.0)).body[2]
    grad = np.ones(4, np.float32).tobytes()
    for step in range(2):
        core.handle(b"a", [P.encode_request(P.PUSH, 0, step, 2, [0]), grad], 0.0)
    assert core.handle(b"a", [P.encode_request(P.PUSH, 0, 2, 3, [0]), grad], 0.0) == []  # held by worker 1
    core.tick(2.0)
    assert core.state.dropped == {1} and core.state.clocks == [3, 0]
    # its pushes are refused until it joins; its init says where it would start
    refused = _reply(core.handle(b"b", [P.encode_request(P.PUSH, 1, 0, 4, [0]), grad], 2.0))
    assert refused.status == P.ERROR and "worker 1 was dropped" in refused.body[0]
    body = _reply(core.handle(b"b", [P.encode_request(P.INIT, 1, 0, 5, [False, SEGS[0], SHAPES])], 2.0)).body
    assert body[1:] == [0, False, 3] and starting_step([body]) == (True, 3)
    assert _reply(core.handle(b"b", [P.encode_request(P.JOIN, 1, 3, 6, [])], 2.0)).body == [3, 3]
    assert core.state.active() == [0, 1] and core.state.clocks == [3, 3]
    assert _reply(core.handle(b"b", [P.encode_request(P.PUSH, 1, 3, 7, [0]), grad], 2.0)).status == P.OK
    assert _reply(core.handle(b"b", [P.encode_request(P.JOIN, 1, 3, 8, [])], 2.0)).body == [4, 4]  # idempotent
    again = _shards(1, 2, "ssp", staleness=1, checkpoint_dir=str(tmp_path), checkpoint_every=1000)[0]
    again.resume()
    assert again.state.active() == [0, 1] and again.state.clocks == [3, 4] and again.state.version == 4


def test_sync_admits_nobody_after_the_start():
    shards = _shards(1, 2, "sync", worker_timeout_s=1.0, on_worker_loss="continue")
    core = shards[0]
    core.handle(b"a", [P.encode_request(P.INIT, 0, 0, 1, [True, SEGS[0], SHAPES]), VALUES[:4].tobytes()], 0.0)
    core.handle(b"b", [P.encode_request(P.INIT, 1, 0, 1, [False, SEGS[0], SHAPES])], 0.0)
    core.handle(b"a", [P.encode_request(P.PUSH, 0, 0, 2, [0]), np.ones(4, np.float32).tobytes()], 0.0)
    core.tick(2.0)
    assert core.state.dropped == {1} and core.state.version == 1
    init = _reply(core.handle(b"b", [P.encode_request(P.INIT, 1, 0, 3, [False, SEGS[0], SHAPES])], 3.0))
    assert init.status == P.ERROR and "a sync job admits no worker after it began" in init.body[0]
    join = _reply(core.handle(b"b", [P.encode_request(P.JOIN, 1, 1, 4, [])], 3.0))
    assert join.status == P.ERROR and "cannot join a sync job" in join.body[0] and core.state.dropped == {1}
    with pytest.raises(ConfigError, match="initial_workers"):
        PsConfig(workers=3, initial_workers=2)  # mode sync
    with pytest.raises(ConfigError, match="initial_workers"):
        PsConfig(workers=3, initial_workers=4, mode="async")


def test_a_join_far_beyond_every_clock_is_refused():
    core = _shards(1, 2, "async", initial_workers=1)[0]
    core.handle(b"a", [P.encode_request(P.INIT, 0, 0, 1, [True, SEGS[0], SHAPES]), VALUES[:4].tobytes()], 0.0)
    body = _reply(core.handle(b"b", [P.encode_request(P.INIT, 1, 0, 1, [False, SEGS[0], SHAPES])], 0.0)).body
    assert body[2:] == [False, 0]
    far = _reply(core.handle(b"b", [P.encode_request(P.JOIN, 1, 50, 2, [])], 0.0))
    assert far.status == P.ERROR and "beyond any worker's step" in far.body[0] and core.state.late == {1}
