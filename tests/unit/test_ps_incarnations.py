"""Two processes under one worker id (a launcher started the same rank twice, or a restarted
worker while the first still runs): a shard on its own thread and real sockets, each PSClient
an incarnation of its own (a nonce drawn at start). The second one claiming a live worker is
refused, naming the worker; one whose predecessor is gone replaces it; no push is ever lost or
mixed in silence."""
import contextlib
import threading
import time

import numpy as np
import pytest

from commrt.launch import free_port
from commrt.ps.client import PSClient
from commrt.ps.server import Server
from commrt.runtime.config import load_config
from commrt.runtime.errors import RequestRejected

ZEROS = {"w": np.zeros(6, np.float32)}


@contextlib.contextmanager
def _shard(workers: int = 2, **ps):
    """One sync shard (plain SGD, lr 1) serving on its own thread on loopback; yields its config."""
    cfg = load_config(overrides={"ps": {"servers": [f"tcp://127.0.0.1:{free_port()}"], "workers": workers,
                                        "lr": 1.0, "timeout_s": 10, "retry_s": 0.1, **ps},
                                 "security": {"mode": "none"}}, environ={})
    server = Server(cfg, 0)
    serving = threading.Thread(target=server.serve, daemon=True)
    serving.start()
    try:
        yield cfg, server
    finally:
        server.stop()
        serving.join(10)


def _wait(cond, what: str) -> None:
    deadline = time.monotonic() + 10
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _parked(server, worker: int, step: int):
    return server.core.waiting.pushes.get((worker, step))


def test_a_second_process_claiming_a_live_worker_is_refused_and_its_push_is_not_mixed_in():
    """Worker 1's first process parks its sync push for step 0; a second process started as
    worker 1 used to be admitted, and its push replaced the first one's in silence (the shard
    applied the second's gradient, then answered the first one's re-send 'duplicate')."""
    with _shard() as (cfg, server):
        zero, first, second = PSClient(cfg, worker=0), PSClient(cfg, worker=1), PSClient(cfg, worker=1)
        try:
            zero.init(ZEROS)
            first.init(ZEROS)
            parked = first.push_async({"w": np.ones(6, np.float32)})
            _wait(lambda: _parked(server, 1, 0), "the first push never reached the shard")
            theirs = _parked(server, 1, 0)
            refused = None
            try:
                second.init(ZEROS)
                second.push_async({"w": np.full(6, 100, np.float32)})
                _wait(lambda: _parked(server, 1, 0) is not theirs, "the second push never reached the shard")
            except RequestRejected as exc:
                refused = exc
            zero.push({"w": np.full(6, 3, np.float32)})
            parked.wait(10)
            got = np.empty(6, np.float32)
            zero.pull({"w": got})
            np.testing.assert_array_equal(got, np.full(6, -2, np.float32))  # (1 + 3) / 2, lr 1
            assert refused is not None and "worker 1" in str(refused) and "another process" in str(refused)
        finally:
            for c in (zero, first, second):
                c.close()


def test_a_process_whose_predecessor_is_gone_replaces_it():
    """The first worker 1 closed (its connection is gone) with a push parked; a new process as
    worker 1 is admitted, the dead one's parked push is void, and the new one's is applied."""
    with _shard() as (cfg, server):
        zero, first = PSClient(cfg, worker=0), PSClient(cfg, worker=1)
        try:
            zero.init(ZEROS)
            first.init(ZEROS)
            first.push_async({"w": np.full(6, 100, np.float32)})
            _wait(lambda: _parked(server, 1, 0), "the push never reached the shard")
        finally:
            first.close()
        second = PSClient(cfg, worker=1)
        try:
            deadline = time.monotonic() + 10
            while True:  # the shard's I/O thread notices the closed connection soon, not at once
                try:
                    second.init(ZEROS)
                    break
                except RequestRejected:
                    assert time.monotonic() < deadline, "the dead worker's id was never released"
                    time.sleep(0.05)
            assert second.step == 0
            pushed = second.push_async({"w": np.ones(6, np.float32)})
            zero.push({"w": np.full(6, 3, np.float32)})
            pushed.wait(10)
            got = np.empty(6, np.float32)
            zero.pull({"w": got})
            np.testing.assert_array_equal(got, np.full(6, -2, np.float32))
        finally:
            second.close()
            zero.close()
