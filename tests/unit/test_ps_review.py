"""A review of the parameter server's request logic for defects a user would hit (each case
names what it found). Fed frames directly, no sockets, as test_ps_hardening does."""
import time

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


# -- the shard's files are released on every exit path -------------------------------------------


def _open_fds_to(path) -> int:
    import os
    fds = os.listdir("/proc/self/fd")
    return sum(1 for fd in fds if os.path.realpath(f"/proc/self/fd/{fd}") == os.path.realpath(path))


def _checkpointed(tmp_path, **ps):
    """A config whose shard 0 has a checkpoint in tmp_path (written by a core seeded directly)."""
    from commrt.launch import free_port
    from commrt.runtime.config import load_config
    cfg = load_config(overrides={"ps": {"servers": [f"tcp://127.0.0.1:{free_port()}"], "workers": 1,
                                        "checkpoint_dir": str(tmp_path), **ps},
                                 "security": {"mode": "none"}}, environ={})
    core = ServerCore(cfg.ps, 0, ShardState(optim.OptimSpec("sgd", lr=0.01), 1))
    v = np.arange(6, dtype=np.float32)
    core.handle(b"w0", [P.encode_request(P.INIT, 0, 0, 1, [True, SEGS, SHAPES]), v[:4].tobytes(), v[4:].tobytes()], 0.0)
    core.close()
    return cfg


def test_a_stopped_shard_closes_its_log(tmp_path):
    """The write-ahead log was opened by the first checkpoint and never closed: every shard a
    process ran (tests, an embedding application) kept its file open until garbage collection."""
    from commrt.ps.server import Server
    cfg = _checkpointed(tmp_path)
    server = Server(cfg, 0, resume=True)
    assert _open_fds_to(tmp_path / "server-0.wal") == 1
    assert server.serve(duration_s=0.05) == 0
    assert _open_fds_to(tmp_path / "server-0.wal") == 0



# -- a malformed reply is a typed error naming the server ----------------------------------------


@pytest.mark.parametrize("status,body", [
    (P.OK, [0]),                     # an init answer too short
    (P.OK, {"a": 1}),                # not a list
    (P.OK, [0, "0", True, 0]),       # a clock that is not a number
    (P.ERROR, []),                   # a refusal without its reason
    (P.LOST, ["gone", ["x"]]),       # a lost worker that is not a worker id
    (P.FAILED, [7]),
])
def test_a_malformed_reply_is_a_protocol_error_naming_the_server(status, body):
    """A reply whose header decodes but whose body does not fit its status and op (a buggy or
    foreign server) escaped as IndexError/TypeError/KeyError from deep inside the client."""
    import threading

    import torch
    import zmq

    from commrt.launch import free_port
    from commrt.ps.client import PSClient
    from commrt.runtime.config import load_config
    from commrt.runtime.errors import ProtocolError
    addr = f"tcp://127.0.0.1:{free_port()}"
    cfg = load_config(overrides={"ps": {"servers": [addr], "workers": 1, "timeout_s": 10},
                                 "security": {"mode": "none"}}, environ={})
    ctx = zmq.Context()
    server = ctx.socket(zmq.ROUTER)
    server.setsockopt(zmq.LINGER, 0)
    server.bind(addr)

    def answer_once():
        if server.poll(10_000):
            ident, head, *_ = server.recv_multipart()
            server.send_multipart([ident, P.encode_reply(status, P.decode_request(head).req_id, body)])
    fake = threading.Thread(target=answer_once, daemon=True)
    fake.start()
    client = PSClient(cfg, worker=1)
    try:
        with pytest.raises(ProtocolError, match="server 0"):
            client.init({"w": torch.zeros(6)})
    finally:
        client.close()
        fake.join(10)
        server.close()
        ctx.term()


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
        np.testing.assert_allclose(shards[0].state.params[0].numpy(), expected)
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


# -- a request the server never reads ends the call ----------------------------------------------


def test_a_request_over_the_servers_frame_limit_is_refused_not_re_sent_for_ever():
    """The worker's [ps] max_segment_bytes is larger than the server's: the seed's frame is over
    the server's limit, ZeroMQ drops the connection, the next ping is answered 'unknown' and
    the client sent the request again, for ever (a hang with no deadline: the pings kept the
    server 'heard'). Now a few copies lost in a row end the call with RequestRejected."""
    import dataclasses
    import threading

    import torch

    from commrt.launch import free_port
    from commrt.ps.client import PSClient
    from commrt.ps.server import Server
    from commrt.runtime.config import load_config
    from commrt.runtime.errors import RequestRejected
    cfg = load_config(overrides={"ps": {"servers": [f"tcp://127.0.0.1:{free_port()}"], "workers": 1,
                                        "timeout_s": 10, "retry_s": 0.1, "max_segment_bytes": 1024},
                                 "security": {"mode": "none"}}, environ={})
    server = Server(cfg, 0)
    serving = threading.Thread(target=server.serve, daemon=True)
    serving.start()
    client = PSClient(dataclasses.replace(cfg, ps=dataclasses.replace(cfg.ps, max_segment_bytes=8 << 20)), worker=0)
    outcome = []

    def init():
        try:
            client.init({"w": torch.zeros((4 << 20) // 4 + 1024)})  # one frame, 1 KiB over the limit there
        except Exception as exc:  # noqa: BLE001 - the outcome is what the test looks at
            outcome.append(exc)
    caller = threading.Thread(target=init, daemon=True)
    caller.start()
    caller.join(30)
    try:
        assert not caller.is_alive(), "the call is still re-sending after 30 s"
        assert len(outcome) == 1 and isinstance(outcome[0], RequestRejected), outcome
        assert "max_segment_bytes" in str(outcome[0]) and "server 0" in str(outcome[0])
    finally:
        server.stop()
        serving.join(10)
        if not caller.is_alive():
            client.close()


def test_an_init_over_the_protocols_limits_is_refused_before_sending():
    """A parameter name longer than the protocol's limit made the server drop the init as
    malformed, unread; the client said nothing clear about why."""
    import torch

    from commrt.launch import free_port
    from commrt.ps.client import PSClient
    from commrt.runtime.config import load_config
    from commrt.runtime.errors import RequestRejected
    cfg = load_config(overrides={"ps": {"servers": [f"tcp://127.0.0.1:{free_port()}"], "workers": 1,
                                        "timeout_s": 5}, "security": {"mode": "none"}}, environ={})
    client = PSClient(cfg, worker=0)  # nobody listens: the refusal must come before any send
    try:
        with pytest.raises(RequestRejected, match=f"refused before sending.*{P.MAX_NAME}"):
            client.init({"n" * (P.MAX_NAME + 1): torch.zeros(2)})
    finally:
        client.close()


# -- closing a client during a call --------------------------------------------------------------


def test_close_during_a_call_cancels_it_with_a_typed_error():
    """Worker 0's sync push waits for worker 1 when another thread closes the client. close()
    waited 5 s for the call, then closed the sockets under it: the call died of a raw
    ZMQError('Socket operation on non-socket') (or worse, inside libzmq)."""
    import threading

    import torch

    from commrt.launch import free_port
    from commrt.ps.client import PSClient
    from commrt.ps.server import Server
    from commrt.runtime.config import load_config
    from commrt.runtime.errors import CommError
    cfg = load_config(overrides={"ps": {"servers": [f"tcp://127.0.0.1:{free_port()}"], "workers": 2,
                                        "timeout_s": 10, "retry_s": 0.1}, "security": {"mode": "none"}}, environ={})
    server = Server(cfg, 0)
    serving = threading.Thread(target=server.serve, daemon=True)
    serving.start()
    clients = [PSClient(cfg, worker=w) for w in range(2)]
    outcome = []

    def push():
        try:
            clients[0].push({"w": torch.ones(4)})
        except Exception as exc:  # noqa: BLE001 - the outcome is what the test looks at
            outcome.append(exc)
    try:
        for c in clients:
            c.init({"w": torch.zeros(4)})
        caller = threading.Thread(target=push, daemon=True)
        caller.start()
        deadline = time.monotonic() + 10
        while server.core.stats()["parked"]["pushes"] < 1:  # the push waits for worker 1 now
            assert time.monotonic() < deadline, "the push never reached the server"
            time.sleep(0.01)
        clients[0].close()
        caller.join(10)
        assert not caller.is_alive()
        assert len(outcome) == 1 and type(outcome[0]) is CommError and "closed" in str(outcome[0]), outcome
    finally:
        for c in clients:
            c.close()
        server.stop()
        serving.join(10)


def test_a_metrics_port_pushed_past_65535_by_the_shard_index_is_a_config_error():
    """Shard I serves metrics on metrics_port + I: 65535 + 1 escaped as OverflowError from
    bind(), which `commrt server` (catching CommError) printed as a traceback."""
    from commrt.launch import free_port
    from commrt.ps.server import Server
    from commrt.runtime.config import load_config
    from commrt.runtime.errors import ConfigError
    cfg = load_config(overrides={"ps": {"servers": [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)],
                                        "workers": 1, "metrics_port": 65535},
                                 "security": {"mode": "none"}}, environ={})
    with pytest.raises(ConfigError, match="65536"):
        Server(cfg, 1)


# -- the demo trainer ----------------------------------------------------------------------------


def test_ps_train_with_no_step_left_ends_cleanly(monkeypatch):
    """A worker that (re)joins a job whose steps are all done starts at client.step >= --steps
    (the same path as --steps 0): its loop never ran and the final report raised
    UnboundLocalError on the loss."""
    import logging
    import threading

    from commrt.apps import ps_train
    from commrt.launch import free_port
    from commrt.ps.server import Server
    from commrt.runtime.config import load_config
    addr = f"tcp://127.0.0.1:{free_port()}"
    env = {"COMMRT_PS_SERVERS": addr, "COMMRT_PS_WORKERS": "1", "COMMRT_SECURITY_MODE": "none", "RANK": "0",
           "COMMRT_PS_TIMEOUT_S": "10"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    # the program's process-wide settings stay out of the test process: its log handlers, threads, seed
    monkeypatch.setattr(ps_train, "reporter", lambda name, who: logging.getLogger(name))
    monkeypatch.setattr(ps_train.torch, "set_num_threads", lambda n: None)
    server = Server(load_config(), 0)
    serving = threading.Thread(target=server.serve, daemon=True)
    serving.start()
    try:
        with ps_train.torch.random.fork_rng():
            assert ps_train.main(["--steps", "0", "--hidden", "8"]) == 0
    finally:
        server.stop()
        serving.join(10)


# -- push_pull with different tensors in grads and into -------------------------------------------


def test_push_pull_into_other_tensors_than_pushed():
    """The pull half returns the pushed segments. Pushing a and b into {a} raised KeyError after
    the push had been applied (the step advanced, the caller could not tell); pushing a into
    {a, b} left b as it was without a word. Now the first writes a (b's values are dropped),
    the second is refused before anything is sent."""
    import threading

    import torch

    from commrt.launch import free_port
    from commrt.ps.client import PSClient
    from commrt.ps.server import Server
    from commrt.runtime.config import load_config
    from commrt.runtime.errors import RequestRejected
    cfg = load_config(overrides={"ps": {"servers": [f"tcp://127.0.0.1:{free_port()}"], "workers": 1, "lr": 1.0,
                                        "timeout_s": 10}, "security": {"mode": "none"}}, environ={})
    server = Server(cfg, 0)
    serving = threading.Thread(target=server.serve, daemon=True)
    serving.start()
    client = PSClient(cfg, worker=0)
    try:
        client.init({"a": torch.zeros(3), "b": torch.zeros(2)})
        a = torch.zeros(3)
        client.push_pull({"a": torch.ones(3), "b": torch.ones(2)}, {"a": a})
        assert client.step == 1 and torch.equal(a, -torch.ones(3))
        b = torch.zeros(2)
        with pytest.raises(RequestRejected, match="'b'"):
            client.push_pull({"a": torch.ones(3)}, {"a": a, "b": b})
        assert client.step == 1 and server.core.state.version == 1
        # a tensor off the host (meta here, CUDA in practice) failed in numpy after the push applied
        with pytest.raises(RequestRejected, match="host memory"):
            client.push_pull({"a": torch.ones(3)}, {"a": torch.zeros(3, device="meta")})
        assert client.step == 1 and server.core.state.version == 1
    finally:
        client.close()
        server.stop()
        serving.join(10)


# -- resuming from a checkpoint another configuration wrote ---------------------------------------


@pytest.mark.parametrize("change", [{"optimizer": "adamw"}, {"workers": 2}, "corrupt"])
def test_resuming_from_an_incompatible_checkpoint_is_a_config_error(tmp_path, change):
    """A checkpoint written for another optimizer or worker count (or a damaged one) stopped
    `commrt server --resume` with a ValueError/KeyError traceback: `commrt server` prints only
    CommErrors as one line."""
    import dataclasses

    from commrt.ps.server import Server
    from commrt.runtime.errors import ConfigError
    cfg = _checkpointed(tmp_path)
    if change == "corrupt":
        ckpt = tmp_path / "server-0.ckpt"
        ckpt.write_bytes(ckpt.read_bytes()[:40])
    else:
        cfg = dataclasses.replace(cfg, ps=dataclasses.replace(cfg.ps, **change))
    with pytest.raises(ConfigError, match="server-0.ckpt"):
        Server(cfg, 0, resume=True)


# -- settings that cannot work together ----------------------------------------------------------


def test_pings_rarer_than_the_silence_deadline_are_refused():
    """A waiting client hears a live server only through its pings' answers: with retry_s >=
    timeout_s a sync push waiting for another worker was PeerLost ('silent') on a healthy server
    before its first ping went out."""
    from commrt.runtime.config import load_config
    from commrt.runtime.errors import ConfigError
    with pytest.raises(ConfigError, match="retry_s"):
        load_config(overrides={"ps": {"timeout_s": 1.0, "retry_s": 1.0}}, environ={})
    load_config(overrides={"ps": {"timeout_s": 1.0, "retry_s": 0.5}}, environ={})


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


def test_a_shard_stopped_by_a_full_disk_still_exits_with_its_status(tmp_path):
    """Closing the log (635e675) flushed what the failed write had left buffered, on the same
    full disk: serve() raised OSError from its finally instead of returning EXIT_STORAGE (seen in
    tests/multirank/test_ps_faults' disk-full case as an exception in the server's thread)."""
    import io

    from commrt.ps.server import EXIT_STORAGE, Server

    class FullDisk(io.BytesIO):
        def flush(self):
            if self.getbuffer().nbytes:
                raise OSError(28, "No space left on device")

        def close(self):
            self.flush()

    server = Server(_checkpointed(tmp_path), 0, resume=True)
    server.core.wal._fh = FullDisk()
    g = np.ones(6, dtype=np.float32)
    out = server.core.handle(b"w0", [P.encode_request(P.PUSH, 0, 0, 5, [0, 1]), g[:4].tobytes(), g[4:].tobytes()], 0.0)
    assert P.decode_reply(out[0].frames[0]).status == P.FAILED
    assert server.serve(duration_s=1.0) == EXIT_STORAGE
