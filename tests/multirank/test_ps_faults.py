"""Parameter-server faults over real sockets (issue 13 items 1, 11, 12, 13, 14, 15): servers run
in threads of the test process (each with its own transport, as in its own process) so the
test can stop, restart and inspect them at chosen points; every wait is for an event.

Every test gets its own job secret (never the per-user secret file)."""
from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import threading
import time

import numpy as np
import pytest
import torch

from commrt import RequestRejected
from commrt.runtime.config import load_config
from commrt.runtime.errors import PeerLost
from commrt.launch import free_port
from commrt.ps import PSClient
from commrt.ps.server import Server
from commrt.transport.security import SECRET_ENV, new_secret

WAIT_S = 60  # generous: a slow shared machine must never turn a pass into a failure


@pytest.fixture(autouse=True)
def own_secret(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, new_secret())


def _cfg(servers: int, workers: int, **ps):
    addrs = tuple(f"tcp://127.0.0.1:{free_port()}" for _ in range(servers))
    ps = {"servers": addrs, "workers": workers, "timeout_s": 20, "retry_s": 0.2, **ps}
    return load_config(overrides={"ps": ps}, environ={})


def _without_durability(cfg):
    return dataclasses.replace(cfg, ps=dataclasses.replace(cfg.ps, checkpoint_dir=""))


class Shard:
    """One server shard serving on a thread until ``stop()``."""

    def __init__(self, cfg, index: int, resume: bool = False):
        self.server = Server(cfg, index, resume=resume)
        self.result = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        self.result = self.server.serve()

    def stop(self):
        self.server.stop()
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive(), "the server did not stop"
        return self.result


def _within(fn, seconds: float = WAIT_S):
    """Run ``fn`` on a thread; its result or exception, or a test failure if it hangs."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the test
            box["error"] = exc
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        pytest.fail(f"hung for {seconds}s")
    return box.get("error", box.get("value"))


def _wait_for(cond, what: str):
    deadline = time.monotonic() + WAIT_S
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"waited {WAIT_S}s for {what}")
        time.sleep(0.01)


# -- 13.1: a worker refused in the handshake -----------------------------------------------------


def test_a_refused_worker_gets_peer_lost_naming_the_server(monkeypatch):
    cfg = _cfg(1, 1, timeout_s=2)
    shard = Shard(cfg, 0)
    try:
        monkeypatch.setenv(SECRET_ENV, new_secret())  # another job's secret
        client = PSClient(cfg, worker=0)
        got = _within(lambda: client.init({"w": torch.zeros(8)}))
        assert isinstance(got, PeerLost) and got.role == "server" and got.rank == 0, got
        assert "secret" in str(got), got
        client.close()
    finally:
        shard.stop()


# -- 13.11 / 13.15: a failed init and bad requests are refused at the client ----------------------


def test_a_client_whose_init_failed_cannot_push():
    cfg = _cfg(1, 2, mode="async", lr=1.0)
    shard = Shard(cfg, 0)
    c0, c1 = PSClient(cfg, worker=0), PSClient(cfg, worker=1)
    try:
        c0.init({"w": torch.zeros(6)})
        with pytest.raises(RequestRejected, match="different parameters"):
            c1.init({"v": torch.zeros(6)})  # same size, another tensor
        with pytest.raises(RequestRejected, match="init"):
            c1.push({"v": torch.ones(6)})
        got = {"w": torch.full((6,), 5.0)}
        c0.pull(got)
        assert torch.equal(got["w"], torch.zeros(6))
        assert shard.server.core.state.version == 0
    finally:
        c0.close()
        c1.close()
        shard.stop()


def test_bad_requests_are_request_rejected_at_the_client():
    cfg = _cfg(1, 1)
    shard = Shard(cfg, 0)
    client = PSClient(cfg, worker=0)
    try:
        with pytest.raises(RequestRejected, match="init"):
            client.push({"w": torch.zeros(6)})
        client.init({"w": torch.zeros(2, 3)})
        with pytest.raises(RequestRejected, match="unknown parameter"):
            client.push({"nope": torch.zeros(6)})
        with pytest.raises(RequestRejected, match="shape"):
            client.push({"w": torch.zeros(3, 2)})
        with pytest.raises(RequestRejected, match="dtype"):
            client.pull({"w": torch.zeros(2, 3, dtype=torch.float64)})
        client.push({"w": torch.ones(2, 3)})  # and it still works
    finally:
        client.close()
        shard.stop()


# -- 13.12: a push torn by an error on another server ---------------------------------------------


def test_an_error_on_one_server_never_tears_the_push_to_another(tmp_path):
    cfg = _cfg(2, 1, lr=1.0, checkpoint_dir=str(tmp_path))
    shards = [Shard(cfg, 0), Shard(cfg, 1)]
    n = 2 * 32768  # 128 KiB per server: large enough to leave without a copy
    start = torch.arange(n, dtype=torch.float32)
    client = PSClient(cfg, worker=0)
    try:
        client.init({"w": start.clone()})
        for s in shards:
            s.stop()
        # server 0 is down (the push waits in the socket's queue); a fresh server 1 refuses it
        shards = [None, Shard(_without_durability(cfg), 1)]
        grad = {"w": torch.ones(n)}
        with pytest.raises(RequestRejected, match="not initialised"):
            client.push(grad)
        grad["w"].fill_(1000.0)  # the user's next step reuses the buffer
        shards[0] = Shard(cfg, 0, resume=True)
        _within(client.stats)  # behind whatever server 0's connection still carried
        half = shards[0].server.core.state.params[0]
        untouched, applied_once = start[:half.size].numpy(), start[:half.size].numpy() - 1.0
        assert np.array_equal(half, untouched) or np.array_equal(half, applied_once), half[:4]
    finally:
        client.close()
        for s in shards:
            if s is not None:
                s.stop()


# -- 13.13: a restarted shard gets each lost request once ----------------------------------------


def test_a_restarted_shard_gets_one_resend_per_restart(tmp_path, caplog):
    cfg = _cfg(1, 2, retry_s=0.05, checkpoint_dir=str(tmp_path))
    shard = Shard(cfg, 0)
    c0, c1 = PSClient(cfg, worker=0), PSClient(cfg, worker=1)
    try:
        c0.init({"w": torch.zeros(4096)})
        c1.init({"w": torch.zeros(4096)})
        work = c0.push_async({"w": torch.ones(4096)})  # parked: sync waits for worker 1
        _wait_for(lambda: shard.server.core.stats()["parked"]["pushes"] == 1, "the parked push")
        shard.stop()
        sent = c0.transport.counters.peer("server0")
        before = sent.sent_msgs
        _wait_for(lambda: sent.sent_msgs >= before + 10, "pings queued during the outage")
        with caplog.at_level(logging.WARNING, logger="commrt.ps.client"):
            shard = Shard(cfg, 0, resume=True)
            c1.push({"w": torch.ones(4096)})
            work.wait(WAIT_S)
        resends = [r for r in caplog.records if "sending it again" in r.getMessage()]
        assert len(resends) == 1, [r.getMessage() for r in resends]
        assert shard.server.core.state.version == 1
    finally:
        c0.close()
        c1.close()
        shard.stop()


# -- 13.14: disk full, and a kill during the first checkpoint ------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    where = tmp_path / "small"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)],
                             capture_output=True).returncode == 0
    if not mounted:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_disk_full_is_reported_to_workers_and_operator(small_disk, caplog):
    cfg = _cfg(1, 1, checkpoint_dir=str(small_disk), checkpoint_every=100000, timeout_s=30)
    shard = Shard(cfg, 0)
    client = PSClient(cfg, worker=0)
    try:
        client.init({"w": torch.zeros(1024)})
        t0 = time.monotonic()

        def train():
            for _ in range(1000):  # 4 KiB of log per step: the 64 KiB disk fills within ~16
                client.push({"w": torch.ones(1024)})
        with caplog.at_level(logging.ERROR, logger="commrt.ps"):
            got = _within(train)
            assert isinstance(got, PeerLost) and got.role == "server" and got.rank == 0, got
            assert "No space left on device" in str(got) and "write" in str(got), got
            assert time.monotonic() - t0 < cfg.ps.timeout_s  # told, not left to time out
            _wait_for(lambda: not shard.thread.is_alive(), "the server to stop")
        assert shard.result != 0
        lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert any("No space left on device" in m and "server 0" in m for m in lines), lines
    finally:
        client.close()
        shard.server.stop()


def test_resume_after_a_kill_during_the_first_checkpoint_starts_fresh(tmp_path):
    cfg = _cfg(1, 1, checkpoint_dir=str(tmp_path))
    with open(tmp_path / "server-0.ckpt.tmp", "wb") as fh:  # all a kill mid-write can leave
        fh.write(b"CMRTCKP1\x10\x00")
    shard = Shard(cfg, 0, resume=True)
    client = PSClient(cfg, worker=0)
    try:
        client.init({"w": torch.arange(6, dtype=torch.float32)})
        client.push({"w": torch.ones(6)})
        assert shard.server.core.state.version == 1
    finally:
        client.close()
        shard.stop()
    assert os.path.exists(tmp_path / "server-0.ckpt")
