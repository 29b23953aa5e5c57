"""The review of the parameter server (see test_ps_review.py), at the process level: a server
shard on its own thread and real sockets, the client against it or against a fake server, files
and settings. Each case names what it found."""
import contextlib
import os
import threading
import time

import numpy as np
import pytest

from commrt.optim import rules as optim
from commrt.ps import protocol as P
from commrt.ps.core import ServerCore
from commrt.ps.state import ShardState

SEGS = [["w", 0, 4, 1], ["w", 4, 6, 1]]


@contextlib.contextmanager
def _one_shard_and_client():
    """A shard (lr 1, plain SGD) serving on its own thread on loopback, and worker 0's client."""
    from commrt.launch import free_port
    from commrt.ps.client import PSClient
    from commrt.ps.server import Server
    from commrt.runtime.config import load_config
    cfg = load_config(overrides={"ps": {"servers": [f"tcp://127.0.0.1:{free_port()}"], "workers": 1, "lr": 1.0,
                                        "timeout_s": 10}, "security": {"mode": "none"}}, environ={})
    server = Server(cfg, 0)
    serving = threading.Thread(target=server.serve, daemon=True)
    serving.start()
    client = PSClient(cfg, worker=0)
    try:
        yield server, client
    finally:
        client.close()
        server.stop()
        serving.join(10)
SHAPES = [["w", [6]]]

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
    import torch

    from commrt.runtime.errors import RequestRejected
    with _one_shard_and_client() as (server, client):
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


def test_read_only_arrays_can_be_pushed_but_not_pulled_into():
    """init and push only read their arrays: a read-only numpy gradient (np.frombuffer of bytes,
    a memory-mapped file) is sent, where as_tensor refused it ("collectives update tensors in
    place"); a pull, which writes, still refuses one."""
    with _one_shard_and_client() as (_, client):
        frozen = np.frombuffer(np.arange(4, dtype=np.float32).tobytes(), np.float32)
        client.init({"w": frozen})
        client.push({"w": frozen})
        got = np.zeros(4, np.float32)
        client.pull({"w": got})
        np.testing.assert_array_equal(got, np.arange(4, dtype=np.float32) * 0)  # w - lr * w
        with pytest.raises(ValueError, match="read-only"):
            client.pull({"w": frozen})


def test_a_new_write_ahead_log_under_fsync_makes_its_directory_entry_durable(tmp_path, monkeypatch):
    """With fsync = true, a new log's name must survive a machine crash too: its directory is
    fsynced once, when the log is created (only the file's own data was). Checked by the fsync
    calls the log makes (a crash cannot be staged here)."""
    from commrt.ps import durable
    synced = []
    real = os.fsync
    monkeypatch.setattr(durable.os, "fsync", lambda fd: (synced.append(os.path.realpath(f"/proc/self/fd/{fd}")),
                                                         real(fd)))
    log = durable.WriteAheadLog(str(tmp_path / "shard0.wal"), fsync=True)
    log.close()
    assert str(tmp_path.resolve()) in synced, synced
    synced.clear()
    durable.WriteAheadLog(str(tmp_path / "shard0.wal"), fsync=True).close()  # reopened: nothing to do
    assert synced == []
