"""A review of the parameter server's request logic for defects a user would hit (each case
names what it found). Fed frames directly, no sockets, as test_ps_hardening does; the cases
that need a server process, sockets or files are in test_ps_review_io.py."""
import numpy as np
import pytest

from commrt.optim import rules as optim
from commrt.runtime.config import PsConfig
from commrt.ps import protocol as P
from commrt.ps.core import ServerCore
from commrt.ps.state import ShardState

SEGS = [["w", 0, 4, 1], ["w", 4, 6, 1]]
SHAPES = [["w", [6]]]


def _replies(out):
    return [(r.ident, P.decode_reply(r.frames[0])) for r in out]


def _core(mode="sync", workers=2, **kw):
    cfg = PsConfig(servers=("tcp://127.0.0.1:1",), workers=workers, mode=mode, lr=0.5, **kw)
    core = ServerCore(cfg, 0, ShardState(optim.OptimSpec("sgd", lr=0.5), workers))
    v = np.arange(6, dtype=np.float32)
    seed = [P.encode_request(P.INIT, 0, 0, 1, [True, SEGS, SHAPES]), v[:4].tobytes(), v[4:].tobytes()]
    assert _replies(core.handle(b"w0", seed, 0.0))[0][1].status == P.OK
    for w in range(1, workers):
        out = core.handle(f"w{w}".encode(), [P.encode_request(P.INIT, w, 0, 1, [False, SEGS, SHAPES])], 0.0)
        assert _replies(out)[0][1].status == P.OK
    return core


def _push(core, worker, step, rid, op=P.PUSH, now=0.0):
    g = np.ones(6, dtype=np.float32)
    head = P.encode_request(op, worker, step, rid, [0, 1])
    return _replies(core.handle(f"w{worker}".encode(), [head, g[:4].tobytes(), g[4:].tobytes()], now))


# -- a failed durable write answers every worker it leaves waiting -------------------------------


def _fail_log_writes(core, after: int = 0):
    """The log's (after+1)-th append and every later one fail as on a full disk."""
    real, calls = core.wal.append, [0]

    def append(*args):
        calls[0] += 1
        if calls[0] > after:
            raise OSError(28, "No space left on device")
        return real(*args)
    core.wal.append = append


def _one_failed_reply_each(out, expected):
    """Each (ident, req_id) in ``expected`` is answered exactly once, with FAILED naming the cause."""
    got = sorted((ident, r.req_id) for ident, r in out)
    assert got == sorted(expected), out
    assert all(r.status == P.FAILED and "No space left" in r.body[0] for _, r in out), out


def test_a_failed_log_write_in_a_sync_step_answers_every_pusher(tmp_path):
    """Worker 0's push_pull waits for worker 1; worker 1's push completes the step, whose log
    write fails. Worker 0's request had been taken out of the parked set for the update, so
    _fail did not see it: worker 0 got no reply, the shard stopped, and it waited out timeout_s
    to learn only that the server went silent."""
    core = _core(checkpoint_dir=str(tmp_path))
    assert _push(core, 0, 0, rid=5, op=P.PUSHPULL) == []
    _fail_log_writes(core)
    _one_failed_reply_each(_push(core, 1, 0, rid=6), [(b"w0", 5), (b"w1", 6)])
    assert core.failure is not None and core.state.version == 0


def test_a_failed_log_write_found_by_the_worker_loss_policy_answers_every_pusher(tmp_path):
    """The same from tick(): worker 2 is dropped, the step of workers 0 and 1 then completes and
    its log write fails."""
    core = _core(workers=3, checkpoint_dir=str(tmp_path), worker_timeout_s=1.0, on_worker_loss="continue")
    assert _push(core, 0, 0, rid=5) == [] and _push(core, 1, 0, rid=6) == []
    _fail_log_writes(core, after=1)  # the drop's record is written, the update's is not
    _one_failed_reply_each(_replies(core.tick(2.0)), [(b"w0", 5), (b"w1", 6)])


def test_a_failed_log_write_keeps_the_answers_already_made(tmp_path):
    """Async: worker 0's step 1 arrived first and waits for its step 0; step 0 arrives, is
    applied and acknowledged, then step 1's log write fails. The acknowledgement made in the same
    call was thrown away with the exception, so step 0's push got no answer at all."""
    core = _core(mode="async", workers=1, checkpoint_dir=str(tmp_path))
    assert _push(core, 0, 1, rid=5) == []
    _fail_log_writes(core, after=1)  # step 0's update is logged, step 1's is not
    out = _push(core, 0, 0, rid=6)
    assert sorted((i, r.req_id, r.status) for i, r in out) == [(b"w0", 5, P.FAILED), (b"w0", 6, P.OK)], out
    assert core.state.version == 1


# -- a shard that holds no key -------------------------------------------------------------------


def _over_shards(shards, worker, op, step, bodies_frames):
    """One call of a worker on every shard (a PSClient call): the replies, in shard order."""
    out = []
    for k, core in enumerate(shards):
        body, frames = bodies_frames[k]
        out += _replies(core.handle(f"w{worker}".encode(), [P.encode_request(op, worker, step, 9, body), *frames], 0.0))
    return out


def test_more_shards_than_keys_train_like_one_process():
    """One 1-element tensor over 3 shards: shards 1 and 2 hold no segment. Such a shard took the
    seed's (empty) description as 'not initialised', so the other worker's init waited for a
    seed that had come, and every push (each reaches every shard) was refused."""
    from commrt.ps.partition import TensorSpec, partition
    n, workers, lr = 3, 2, 0.5
    segs = partition([TensorSpec("w", 1, 4, 1)], n, 1 << 20)
    assert [s.server for s in segs] == [0]
    desc = [[[s.name, s.start, s.stop, s.dtype] for s in segs if s.server == k] for k in range(n)]
    cfg = PsConfig(servers=tuple(f"tcp://127.0.0.1:{k + 1}" for k in range(n)), workers=workers, lr=lr)
    shards = [ServerCore(cfg, k, ShardState(optim.OptimSpec("sgd", lr=lr), workers)) for k in range(n)]
    w0 = np.array([3.0], dtype=np.float32)
    for w in range(workers):
        init = [([w == 0, desc[k], [["w", [1]]]], [w0.tobytes()] if desc[k] and w == 0 else []) for k in range(n)]
        replies = _over_shards(shards, w, P.INIT, 0, init)
        assert [r.status for _, r in replies] == [P.OK] * n, replies
    expected = w0.copy()
    for step in range(3):
        grads = [np.array([step + w + 1.0], dtype=np.float32) for w in range(workers)]
        replies = []
        for w in range(workers):
            calls = [([0] if desc[k] else [], [grads[w].tobytes()] if desc[k] else []) for k in range(n)]
            replies += _over_shards(shards, w, P.PUSHPULL, step, calls)
        assert len(replies) == n * workers and all(r.status == P.OK for _, r in replies), replies
        expected -= lr * (grads[0] + grads[1]) / 2
        np.testing.assert_allclose(shards[0].state.params[0], expected)
    assert [s.state.version for s in shards] == [3, 3, 3]


# -- the worker-loss policy blames whom a request waits for ---------------------------------------


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_a_push_waiting_for_its_own_earlier_step_blames_only_its_worker(mode):
    """Worker 0's step 2 arrived without its step 1 (a buggy client, or one whose push was lost);
    worker 1 is idle at step 0, which async mode never waits for (nor SSP with s = 5). The policy
    blamed every worker whose clock was below 2: under on_worker_loss = continue the healthy
    worker 1 was dropped, and its next request refused."""
    core = _core(mode=mode, staleness=5, worker_timeout_s=1.0, on_worker_loss="continue")
    assert _push(core, 0, 0, rid=5)[0][1].status == P.OK
    assert _push(core, 0, 2, rid=6) == []
    out = _replies(core.tick(2.0))
    assert [(i, r.status) for i, r in out] == [(b"w0", P.ERROR)] and "dropped" in out[0][1].body[0], out
    assert core.state.dropped == {0}
    assert _push(core, 1, 0, rid=7)[0][1].status == P.OK


# -- every request is answered once, or still parked -----------------------------------------------


def test_a_rejoin_refuses_what_the_earlier_life_left_parked():
    """SSP, s = 0: worker 0's pull at step 1 waits for worker 1; worker 0 then (re)joins at step
    3. The pull was removed as void, but its refusal was thrown away: no answer, ever."""
    core = _core(mode="ssp", staleness=0)
    assert _push(core, 0, 0, rid=5)[0][1].status == P.OK
    assert _replies(core.handle(b"w0", [P.encode_request(P.PULL, 0, 1, 6, [0, 1])], 0.0)) == []
    out = _replies(core.handle(b"w0new", [P.encode_request(P.JOIN, 0, 3, 7, [])], 0.0))
    assert [(i, r.req_id, r.status) for i, r in out] == [(b"w0", 6, P.ERROR), (b"w0new", 7, P.OK)], out
    assert "void" in out[0][1].body[0]


def _random_request(rng, core, rid):
    """One request of a random kind from a random worker, near its clock."""
    w = rng.randrange(core.state.workers)
    op = rng.choice([P.INIT, P.PUSH, P.PULL, P.PUSHPULL, P.JOIN])
    step = max(0, core.state.clocks[w] + rng.randint(-1, 2))
    if op == P.INIT:
        v = np.zeros(6, dtype=np.float32)
        return w, [P.encode_request(op, w, step, rid, [w == 0, SEGS, SHAPES])] + (
            [v[:4].tobytes(), v[4:].tobytes()] if w == 0 else [])
    if op == P.JOIN:
        return w, [P.encode_request(op, w, step, rid, [])]
    ids = sorted(rng.sample(range(2), rng.randint(0, 2)))
    g = np.full(6, rng.random(), dtype=np.float32)
    parts = {0: g[:4].tobytes(), 1: g[4:].tobytes()}
    return w, [P.encode_request(op, w, step, rid, ids)] + ([parts[i] for i in ids] if op != P.PULL else [])


@pytest.mark.parametrize("mode", ["sync", "async", "ssp"])
def test_every_request_is_answered_once_or_still_parked(tmp_path, mode):
    """Random requests (re-sends, far steps, joins) with the worker-loss policy ticking and the
    log failing as on a full disk at a random write: at every point each request was answered
    at most once, or is still parked; once the shard has failed, none is left unanswered. Found
    the refusals a JOIN threw away, and the pushes a failed write left unanswered."""
    import random
    for seed in range(4):
        rng = random.Random(seed)
        core = _core(mode=mode, workers=3, staleness=1, worker_timeout_s=1.0, checkpoint_dir=str(tmp_path / f"{seed}"),
                     checkpoint_every=3, on_worker_loss=rng.choice(["error", "continue"]),
                     initial_workers=0 if mode == "sync" else 2)
        _fail_log_writes(core, after=rng.randint(0, 4))
        answers, sent, now = {}, set(), 0.0
        for rid in range(100, 600):
            now += rng.random() * 0.3
            w, frames = _random_request(rng, core, rid)
            head = P.decode_request(frames[0])
            if head.op in (P.PUSH, P.PUSHPULL) and (w, head.step) in core.pushes:  # a re-send replaces it
                answers[(w, core.pushes[(w, head.step)].req.req_id)] = "superseded"
            sent.add((w, rid))
            for ident, r in _replies(core.handle(f"w{w}".encode(), frames, now) + core.tick(now)):
                key = (int(ident[1:]), r.req_id)
                assert key not in answers, (seed, key, "answered twice")
                answers[key] = r.status
            left = sent - set(answers)
            if core.failure is not None:
                assert not left, (seed, "unanswered after the failure", left)
                break
            assert left == {(p.req.worker, p.req.req_id) for p in core.waiting.all()}, (seed, rid)


# -- the staleness histogram stays a size a reply can carry ----------------------------------------


def test_stats_stay_decodable_when_async_gaps_keep_growing():
    """Async never waits for a worker, so an idle (or dead) one holds the slowest clock and every
    update opens a new staleness gap: one histogram key per step. Past 4096 keys the STATS reply
    was over the client's map limit, dropped as malformed, and server-status never answered."""
    from commrt.ps.state import MAX_GAP
    core = _core(mode="async")
    g = np.zeros(6, dtype=np.float32)
    for step in range(4200):
        head = P.encode_request(P.PUSH, 0, step, step + 10, [0, 1])
        core.handle(b"w0", [head, g[:4].tobytes(), g[4:].tobytes()], 0.0)
    assert core.state.version == 4200
    out = core.handle(b"w0", [P.encode_request(P.STATS, 0, 0, 1, [])], 0.0)
    stats = P.decode_reply(out[0].frames[0]).body
    assert sum(stats["staleness"].values()) == 4200 and max(map(int, stats["staleness"])) == MAX_GAP


def test_a_checkpoint_dir_that_cannot_be_made_is_a_config_error(tmp_path):
    """os.makedirs' NotADirectoryError / PermissionError reached `commrt server` as a traceback."""
    from commrt.runtime.errors import ConfigError
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cfg = PsConfig(servers=("tcp://127.0.0.1:1",), workers=1, checkpoint_dir=str(blocker / "ckpt"))
    with pytest.raises(ConfigError, match="checkpoint_dir"):
        ServerCore(cfg, 0, ShardState(optim.OptimSpec("sgd", lr=0.5), 1))


# -- a sync step averages over its members, not over whoever pushed a segment ---------------------


def test_a_sync_step_averages_a_segment_only_some_workers_pushed_over_every_member():
    """Worker 1 pushes only the first segment (a parameter its batch left without a gradient:
    torch DDP counts it as zero). The step's average of the second segment divided worker 0's
    gradient by the count of workers that pushed it (1), not by the members (2): that
    parameter moved twice as far as in a single process that averages both batches."""
    core = _core("sync", workers=2)
    v = np.arange(6, dtype=np.float32)
    g0, g1 = np.full(6, 2.0, dtype=np.float32), np.full(4, 4.0, dtype=np.float32)
    out = _replies(core.handle(b"w0", [P.encode_request(P.PUSH, 0, 0, 1, [0, 1]), g0[:4].tobytes(),
                                       g0[4:].tobytes()], 0.0))
    out += _replies(core.handle(b"w1", [P.encode_request(P.PUSH, 1, 0, 1, [0]), g1.tobytes()], 0.0))
    assert [r.status for _, r in out] == [P.OK, P.OK], out
    lr = 0.5
    want = np.concatenate([v[:4] - lr * (g0[:4] + g1) / 2, v[4:] - lr * (g0[4:] + 0) / 2])
    got = np.concatenate(core.state.params[:2])
    np.testing.assert_allclose(got, want)
