"""The per-group executor and the endpoint's bounds, in one process (no peers needed: a
size-1 group runs every collective locally; endpoints talk over loopback to each other)."""
import sys
import threading
import time

import pytest
import torch

from commrt.backends.zmq_backend import ZmqBackend
from commrt.runtime.config import load_config
from commrt.runtime.errors import CommError, GroupClosed, PeerLost, ProtocolError
from commrt.transport import Endpoint, Transport
from commrt.transport.wire import COLL, P2P, Header
from commrt.runtime.work import CommTimeout, Executor


@pytest.fixture
def cfg():
    return load_config(None, {"comm": {"timeout_s": 2.0, "heartbeat_s": 0.2, "backend": "zmq"},
                              "security": {"mode": "none"}})


@pytest.fixture
def backend(cfg):
    transport = Transport(cfg, "rank0")
    be = ZmqBackend(transport, cfg, 0, 1, 0)
    be.connect([be.addresses])
    yield be
    be.close()
    transport.close()


def test_sequence_numbers_follow_execution_order_across_threads(backend, monkeypatch):
    """seq is taken when an op starts, in the order the group runs them: two threads issuing at
    once can never run seq 6 before seq 5 (before: seq taken before the enqueue, unlocked)."""
    seen = []
    monkeypatch.setattr("commrt.collectives.ops.barrier", lambda ctx: seen.append(ctx.seq))
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        def issue():
            works = [backend.barrier(async_op=True) for _ in range(300)]
            for w in works:
                w.wait(30)
        threads = [threading.Thread(target=issue) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert seen == sorted(seen) and len(seen) == 1200


def test_sync_op_waits_behind_progressing_work_without_timing_out():
    ex, done = Executor("g"), []
    gate = threading.Semaphore(0)
    works = [ex.submit(f"op{i}", lambda i=i: (gate.acquire(), done.append(i))) for i in range(5)]

    def release_slowly():  # each queued op finishes within the timeout, the queue as a whole not
        for _ in works:
            gate.release()
            ex_progress.wait(5)
            ex_progress.clear()
    ex_progress = threading.Event()
    orig = ex._done
    ex._done = lambda: (orig(), ex_progress.set())
    threading.Thread(target=release_slowly, daemon=True).start()
    assert ex.run("sync", lambda: "ran", timeout_s=1.0) == "ran"
    assert done == [0, 1, 2, 3, 4]
    assert ex.close()


def test_sync_op_that_gives_up_uses_no_sequence_number_and_breaks_the_group(backend):
    """Behind work that stopped progressing, a sync op gives up before it starts: it used no
    sequence number, and the group refuses later work instead of desynchronising."""
    stuck = threading.Event()
    backend._exec.submit("stuck", lambda: stuck.wait(30))
    seq = backend._seq
    try:
        with pytest.raises(CommTimeout, match="no earlier operation finished within 2s"):
            backend.barrier()
    finally:
        stuck.set()
    assert backend._seq == seq
    with pytest.raises(CommError, match="unusable"):
        backend.barrier()


def test_close_cancels_running_and_queued_work(backend):
    started = threading.Event()

    def blocked(ctx):
        started.set()
        backend._coll.peer_addresses[1] = "tcp://127.0.0.1:9"  # a peer that never answers
        backend._coll.names.append("rank1")
        backend._coll._counters.append(backend._coll._counters[0])
        backend._coll._ahead.append([0, 0])
        backend._coll.recv(1, op=ctx.name, seq=ctx.seq, timeout_s=60)
    import commrt.collectives.ops as ops
    orig, ops.barrier = ops.barrier, blocked
    try:
        running = backend.barrier(async_op=True)
        queued = backend.barrier(async_op=True)
        assert started.wait(10)
        assert backend.close(timeout_s=10)  # stopped: the owner gave back its turn
    finally:
        ops.barrier = orig
    with pytest.raises(GroupClosed, match=r"barrier \(seq 1\) cancelled"):
        running.wait(10)
    with pytest.raises(GroupClosed, match="not started"):
        queued.wait(10)


def _pair(cfg, transport):
    names = ["rank0", "rank1"]
    a, b = (Endpoint(transport, 0, r, names, "127.0.0.1", "", 1 << 20, 0.2, 2.0) for r in (0, 1))
    for ep in (a, b):
        ep.connect({0: a.address, 1: b.address})
    return a, b


def test_read_ahead_is_bounded_per_peer_and_names_it(cfg):
    transport = Transport(cfg, "rank0")
    a, b = _pair(cfg, transport)
    try:
        a.ahead_limit = (5, 1 << 20)
        for i in range(10):  # point-to-point messages on tag 7 while rank 0 waits on tag 8
            b.send(0, Header(P2P, 0, i, 1, 7, 1, 1, 0, 4), b"\0\0\0\0")
        with pytest.raises(ProtocolError, match="peer rank 1 sent more than"):
            a.recv(1, tag=8, timeout_s=5)
    finally:
        a.close()
        b.close()
        transport.close()


def test_busy_peer_does_not_extend_a_wait(cfg):
    """Messages for another channel keep arriving faster than a slice: the wait on tag 8
    still ends at its deadline (before: only an empty slice checked the deadline)."""
    transport = Transport(cfg, "rank0")
    a, b = _pair(cfg, transport)
    stop = threading.Event()

    def chatter():
        while not stop.is_set():
            b.send(0, Header(P2P, 0, 1, 1, 7, 1, 0, 0, 0), b"")
            stop.wait(0.005)
    t = threading.Thread(target=chatter)
    try:
        t.start()
        with pytest.raises(PeerLost, match="timeout after 0.3s: no message"):
            a.recv(1, tag=8, timeout_s=0.3)
    finally:
        stop.set()
        t.join()
        a.close()
        b.close()
        transport.close()


def test_waiters_are_woken_when_the_turn_comes_back_not_at_their_deadline():
    """_done skips the notify when nobody waits (issue 17, small ops): a caller queued behind
    an async op, and a worker with an async op queued behind a sync one, must still wake when
    the running op ends (their deadlines are far beyond the join's bound)."""
    ex = Executor("t")
    release, ran = threading.Event(), []
    first = ex.submit("async", release.wait)
    caller = threading.Thread(target=lambda: ran.append(ex.run("sync", lambda: "s", 600.0)))
    caller.start()
    _until_someone_waits(ex)
    release.set()
    caller.join(60)
    assert ran == ["s"] and first.wait(60)

    started, release = threading.Event(), threading.Event()

    def sync_op():
        started.set()
        release.wait(60)
    runner = threading.Thread(target=ex.run, args=("sync", sync_op, 600.0))
    runner.start()
    assert started.wait(60)
    queued = ex.submit("async", lambda: "a")  # the worker now waits for the turn
    _until_someone_waits(ex)
    release.set()
    runner.join(60)
    assert queued.wait(60) and queued.result() == "a"
    ex.close()


def _until_someone_waits(ex: Executor) -> None:
    deadline = time.monotonic() + 60
    while not ex._waiting and time.monotonic() < deadline:
        time.sleep(0.005)
    assert ex._waiting, "nobody started waiting for the turn"


def test_a_callback_that_raises_neither_fails_the_op_nor_skips_the_others(caplog):
    """Work._finish ran the done-callbacks in a row: one that raised skipped the rest (a torch
    future never settled), and on an executor thread the op, which had succeeded, was finished
    again as failed with the callback's error. The error is now logged, once per callback."""
    ex, ran, started = Executor("cb"), [], threading.Event()
    try:
        work = ex.submit("all_reduce", lambda: (started.wait(5), 42)[1])

        def bad(w):
            raise RuntimeError("callback bug")
        work.add_done_callback(bad)
        work.add_done_callback(lambda w: ran.append(w.result()))
        with caplog.at_level("ERROR", logger="commrt.runtime.work"):
            started.set()
            assert work.wait(5) and work.result() == 42 and work.is_success() and work.exception() is None
            deadline = time.monotonic() + 5
            while not ran and time.monotonic() < deadline:
                time.sleep(0.01)
        assert ran == [42]
        assert any("callback bug" in r.getMessage() or "callback bug" in str(r.exc_info) for r in caplog.records)
        late = []
        work.add_done_callback(bad)  # registered after the end: runs at once, logged, not raised
        work.add_done_callback(lambda w: late.append(1))
        assert late == [1]
    finally:
        ex.close()
