"""The point-to-point engine (transport/p2p.py) on real sockets in one process: two Endpoints on
two Transports (two ZeroMQ contexts, as two processes would have), a PointToPoint on each."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from commrt.backends.zmq_p2p import PointToPoint
from commrt.runtime.config import load_config
from commrt.runtime.errors import GroupClosed, ProtocolError
from commrt.runtime.work import CommTimeout
from commrt.transport import Endpoint, Transport, p2p, segments, shm_p2p
from commrt.transport.mailbox import W_MHEAD, W_SPIN
from commrt.transport.p2p import P2PEngine
from commrt.transport.progress import ENGINE

TIMEOUT_S = 20.0


def _pair(rings: bool):
    cfg = load_config(None, {"comm": {"backend": "zmq"}, "security": {"mode": "none"}})
    names = ["rank0", "rank1"]
    transports = [Transport(cfg, n) for n in names]
    eps = [Endpoint(t, 0, r, names, "127.0.0.1", "", 1 << 20, 1.0, TIMEOUT_S) for r, t in enumerate(transports)]
    for ep in eps:
        ep.connect({r: e.address for r, e in enumerate(eps)})
    engines = [P2PEngine(ep, TIMEOUT_S) for ep in eps]
    if rings:  # each rank's ring to the other, mapped by both as a shared-memory group's setup does
        made = [shm_p2p.make_ring() for _ in engines]
        for r, e in enumerate(engines):
            fd = made[1 - r][0]
            e.use_shm({1 - r: (shm_p2p.OutRing(*made[r]), shm_p2p.InRing(segments.attach(fd, shm_p2p.RING_SLOT)))})
    return transports, engines


@pytest.fixture(params=[False])
def pair(request):
    """(engine, PointToPoint) of ranks 0 and 1 of one group, connected (with shared-memory
    rings when the parameter says so); closed afterwards."""
    transports, engines = _pair(request.param)
    yield [(e, PointToPoint(e, 0, r, 2, 1 << 20)) for r, e in enumerate(engines)]
    for e in engines:
        e.close(5.0)
    for t in transports:
        t.close()


def _until(cond, what: str, limit_s: float = 10.0) -> None:
    end = time.monotonic() + limit_s
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"{what} within {limit_s}s")
        time.sleep(0.001)


@pytest.mark.parametrize("how", ["fails", "closes"])
def test_a_waiter_queued_for_the_socket_wakes_when_the_engine_stops(pair, how):
    """A receive's wait() asks the engine for the socket; the engine stops first (a bug in its
    loop, or the group closed in that instant) and fails every transfer: the waiter must get
    that error, not sleep for ever on the socket it asked for."""
    (engine, p2p), _ = pair
    work = p2p.irecv(np.zeros(4, np.float32), 1)
    progress = engine._out.progress
    raised, started = [], []

    def wait():
        try:
            work.wait()
        except BaseException as exc:
            raised.append(exc)
    waiter = threading.Thread(target=wait, daemon=True)

    def stop_with_a_waiter(now):
        # The waiter starts from here, in the engine's turn while it holds the socket, so it
        # queues for the socket before the engine can hand it over (started earlier, the engine
        # gave it the socket at the top of its next turn, and nothing stopped: a flaky test)
        if engine._reader.holder == ENGINE and not started:
            waiter.start()
            started.append(True)
            _until(lambda: engine._reader.wanted, "the waiter asks for the socket")
            if how == "fails":
                raise RuntimeError("a bug in the engine's loop")
            engine._closing = True  # close()'s first step, from another thread
        progress(now)
    engine._out.progress = stop_with_a_waiter
    _until(lambda: started, "the engine reads for the unwatched receive")
    waiter.join(10.0)
    assert not waiter.is_alive(), "the waiter still sleeps on the socket"
    assert len(raised) == 1 and isinstance(raised[0], RuntimeError if how == "fails" else GroupClosed), raised


@pytest.mark.parametrize("chunk", [1 << 20, 64])
def test_a_receive_into_a_non_contiguous_tensor_gets_every_value_in_its_layout(pair, chunk):
    """The receive lands in a contiguous copy and writes it back (one piece, and in pieces);
    what lies between the view's elements is untouched."""
    torch = pytest.importorskip("torch")
    (e0, _), (e1, _) = pair
    send, recv = PointToPoint(e0, 0, 0, 2, chunk), PointToPoint(e1, 0, 1, 2, chunk)
    sent = torch.arange(6 * 5, dtype=torch.float32).reshape(6, 5) + 1
    base = torch.zeros(5, 12)
    view = base[:, ::2].t()  # 6 x 5, strided both ways
    work = recv.irecv(view, 0, tag=3)
    send.isend(sent, 1, tag=3).wait(TIMEOUT_S)
    assert work.wait(TIMEOUT_S) and torch.equal(view, sent)
    assert torch.equal(base[:, 1::2], torch.zeros(5, 6))


def test_a_waiter_whose_receive_another_reader_matched_from_kept_messages_wakes(pair):
    """Thread A reads the socket for its own receive; thread B's receive, posted meanwhile, is
    matched by A against a message kept earlier: B must wake then, not when A's receive ends."""
    (engine, p2p0), (_, p2p1) = pair
    p2p1.isend(np.full(4, 2.0, np.float32), 0, tag=2).wait(TIMEOUT_S)
    mine = p2p0.irecv(np.zeros(4, np.float32), 1, tag=1)
    a = threading.Thread(target=mine.wait, daemon=True)
    a.start()
    _until(lambda: engine._match.early_bytes[1], "thread A reads and keeps the tag-2 message")
    got = np.zeros(4, np.float32)
    theirs = p2p0.irecv(got, 1, tag=2)
    b = threading.Thread(target=theirs.wait, daemon=True)
    b.start()
    b.join(5.0)
    try:
        assert not b.is_alive(), "thread B sleeps while its receive is done"
        assert (got == 2.0).all()
    finally:
        p2p1.isend(np.ones(4, np.float32), 0, tag=1).wait(TIMEOUT_S)
        a.join(TIMEOUT_S)


@pytest.mark.parametrize("pair", [True], indirect=True)
def test_a_corrupt_mailbox_fails_its_peer_once_and_the_pair_goes_on_over_the_socket(pair, caplog):
    """A mailbox record that breaks the rules is a ProtocolError against its sender, once: the
    mailbox is not read again (its sender, seeing nobody spin on it, takes the socket), where
    it was read and failed again on every turn of the engine."""
    (engine, p2p0), (other, p2p1) = pair
    p2p1.isend(np.ones(4, np.float32), 0).wait(TIMEOUT_S)  # both sides' rings in place
    p2p0.irecv(np.zeros(4, np.float32), 1).wait(TIMEOUT_S)
    box = other._rings._out[0]._ctl
    box[W_MHEAD] = box[W_MHEAD] + (1 << 40)  # a head no mailbox reaches
    failed = p2p0.irecv(np.zeros(4, np.float32), 1, tag=5)
    with pytest.raises(Exception, match="mailbox head"):
        failed.wait(TIMEOUT_S)
    time.sleep(0.5)  # the engine's turns
    got = np.zeros(4, np.float32)
    work = p2p0.irecv(got, 1, tag=6)
    p2p1.isend(np.full(4, 6.0, np.float32), 0, tag=6).wait(TIMEOUT_S)
    assert work.wait(TIMEOUT_S) and (got == 6.0).all()
    warned = [r for r in caplog.records if "mailbox head" in r.getMessage()]
    assert len(warned) == 1, len(warned)


@pytest.mark.parametrize("pair", [True], indirect=True)
def test_a_message_left_in_the_mailbox_without_a_doorbell_is_read_within_a_slice(pair):
    """A sender that saw the receiver spinning writes into its mailbox and rings no doorbell;
    should the receiver have stopped spinning meanwhile and the doorbell be lost (a full pipe),
    a reader still looks at the mailboxes once a slice (mailbox.py rule 3), also a caller
    blocked on the socket, not only the engine thread."""
    (engine, p2p0), (other, p2p1) = pair
    p2p1.isend(np.ones(4, np.float32), 0).wait(TIMEOUT_S)  # both sides' rings in place
    p2p0.irecv(np.zeros(4, np.float32), 1).wait(TIMEOUT_S)
    got = np.zeros(4, np.float32)
    work = p2p0.irecv(got, 1, tag=7)
    waiter = threading.Thread(target=work.wait, daemon=True)
    waiter.start()
    ctl = other._rings._out[0]._ctl
    _until(lambda: engine._reader.holder not in (None, ENGINE), "the caller reads the socket")
    time.sleep(0.1)  # its 2 ms of spinning are over: it blocks on the socket
    assert not ctl[W_SPIN]
    ctl[W_SPIN] = 1  # as the sender saw it an instant before the receiver stopped spinning
    p2p1.isend(np.full(4, 7.0, np.float32), 0, tag=7).wait(TIMEOUT_S)
    ctl[W_SPIN] = 0
    assert other._rings.mailed >= 1  # it went into the mailbox, no doorbell rung
    waiter.join(5.0)
    try:
        assert not waiter.is_alive() and (got == 7.0).all(), "the message waits in the mailbox"
    finally:
        if waiter.is_alive():
            p2p1.isend(np.zeros(0, np.float32), 0, tag=8).wait(TIMEOUT_S)


def test_a_receive_posted_behind_others_runs_none_of_their_callbacks_under_the_p2p_lock(pair):
    """irecv holds the group's PointToPoint lock while it posts; a receive posted earlier, while
    another thread read the socket, waits in _posted with a done-callback that sends. The new
    receive matched it against the message kept for it and ran that callback in the poster's
    thread, still under the lock the callback's isend takes: that thread hung for ever. The
    engine thread is kept from starting, so only the threads here read the socket."""
    (engine, p2p0), (_, p2p1) = pair
    engine._thread = threading.Thread()  # never started: _start sees an engine
    try:
        assert engine._reader.try_take("another reader")
        first = p2p0.irecv(np.zeros(4, np.float32), 1, tag=1)  # the socket is busy: into _posted
        forwarded = []
        first.add_done_callback(lambda w: forwarded.append(p2p0.isend(np.ones(1, np.float32), 1, tag=9)))
        p2p1.isend(np.full(4, 1.0, np.float32), 0, tag=1).wait(TIMEOUT_S)
        _until(lambda: engine._read_all() or engine._match.early_bytes[1], "the tag-1 message is kept")
        engine._reader.release()
        poster = threading.Thread(target=p2p0.irecv, args=(np.zeros(4, np.float32), 1, 2), daemon=True)
        poster.start()
        poster.join(5.0)
        assert not poster.is_alive(), "irecv hangs: an earlier receive's callback ran under its lock"
        assert first.wait(TIMEOUT_S) and len(forwarded) == 1
        got = np.zeros(1, np.float32)
        assert p2p1.irecv(got, 0, tag=9).wait(TIMEOUT_S) and got[0] == 1.0
    finally:
        engine._thread = None  # close() closes the sockets itself


def test_a_wait_leaves_the_socket_to_the_next_wait_and_wakes_the_engine_only_for_callbacks(pair, monkeypatch):
    """A pipeline posts a step's receives at its start. When a wait ended with receives still
    posted, it woke the engine, which took the socket, and the stage's next wait had to ask for
    it back (a thread hop per receive). Now a wait wakes the engine only for a receive with a
    done-callback, which no wait will land. The engine thread is kept from starting, so the
    wake-ups here are the waits' and the callbacks' own."""
    (engine, p2p0), (_, p2p1) = pair
    engine._thread = threading.Thread()  # never started: _start sees an engine
    wakes = []
    monkeypatch.setattr(engine, "_wake", lambda: wakes.append(1))
    try:
        a, b = np.zeros(4, np.float32), np.zeros(4, np.float32)
        first, second = p2p0.irecv(a, 1, tag=1), p2p0.irecv(b, 1, tag=2)
        p2p1.isend(np.full(4, 1.0, np.float32), 0, tag=1).wait(TIMEOUT_S)
        assert first.wait(TIMEOUT_S) and a[0] == 1.0
        assert wakes == [], "a wait woke the engine for a receive another wait will land"
        called = []
        second.add_done_callback(called.append)  # kicks the engine: it must land this one
        assert len(wakes) == 1
        third = p2p0.irecv(np.zeros(4, np.float32), 1, tag=3)
        p2p1.isend(np.full(4, 3.0, np.float32), 0, tag=3).wait(TIMEOUT_S)
        assert third.wait(TIMEOUT_S)
        assert len(wakes) == 2, "a wait left a receive with a callback to nobody"
        p2p1.isend(np.full(4, 2.0, np.float32), 0, tag=2).wait(TIMEOUT_S)
        assert second.wait(TIMEOUT_S) and b[0] == 2.0 and called == [second]
    finally:
        engine._thread = None  # close() closes the sockets itself


def test_a_flood_of_unreceived_data_is_a_protocol_error_naming_global_ranks(pair, monkeypatch):
    """A subgroup's transport numbers peers by group rank; the flood error said "peer rank 1"
    for group [3, 8]'s rank 1, which a user reads as global rank 1, another process."""
    (engine, p2p0), (_, p2p1) = pair
    engine._members = [3, 8]  # as a subgroup's backend builds it (ZmqBackend: members=)
    monkeypatch.setattr(p2p, "UNEXPECTED_BYTES", 64)
    waiting = p2p0.irecv(np.zeros(4, np.float32), 1, tag=1)
    p2p1.isend(np.zeros(32, np.float32), 0, tag=2).wait(TIMEOUT_S)  # 128 bytes nobody asked for
    with pytest.raises(ProtocolError) as caught:
        waiting.wait(TIMEOUT_S)
    assert "rank 3: peer rank 8 of group 0 sent more than" in str(caught.value), caught.value


def test_a_flood_of_unreceived_empty_messages_is_a_protocol_error_too(pair, monkeypatch):
    """Review revF: the bound on what a peer sends ahead counted bytes only, so empty messages
    (isends of zero-element tensors nobody receives: a signal sent every step) were kept for ever,
    a few hundred bytes of Python objects each, with no error; the collectives' read-ahead bounds
    messages and bytes alike."""
    (_, p2p0), (_, p2p1) = pair
    monkeypatch.setattr(p2p, "UNEXPECTED_MSGS", 50, raising=False)
    waiting = p2p0.irecv(np.zeros(4, np.float32), 1, tag=1)
    for _ in range(60):
        p2p1.isend(np.zeros(0, np.float32), 0, tag=2).wait(TIMEOUT_S)
    with pytest.raises(ProtocolError, match="more than 50 messages"):
        waiting.wait(5.0)


def test_a_receive_that_times_out_names_the_timeout_the_caller_gave(pair):
    """Review revF: P2PWork.wait read the socket until the deadline, then passed what was left
    of the timeout (nothing) on, so wait(0.3) raised 'recv did not complete within 0.0s'."""
    (_, p2p0), _ = pair
    with pytest.raises(CommTimeout, match=r"within 0\.3s"):
        p2p0.irecv(np.zeros(4, np.float32), 1, tag=1).wait(0.3)


@pytest.mark.parametrize("pair", [True], indirect=True)
def test_a_ring_that_cannot_be_reserved_sends_on_the_socket_and_the_peers_ring_to_us_still_works(pair, monkeypatch):
    """Memory too short for our ring to rank 1 (posix_fallocate fails) sends to it inline, as
    shm_p2p.Rings._ready says. The ring rank 1 sends to us through is its own, reserved fine;
    but our ring's failure took rank 1 out of the ring peers both ways, so its next large
    payload, a descriptor in its ring, was refused as 'not on this node's group' (ProtocolError,
    the receive failed)."""
    (e0, p2p0), (e1, p2p1) = pair
    big = np.arange(16 << 10, dtype=np.float32)  # 64 KiB: ring-sized (shm_p2p.MIN_BYTES is 32 KiB)
    with monkeypatch.context() as m:
        m.setattr(shm_p2p.shm, "reserve", lambda fd: (_ for _ in ()).throw(OSError(28, "No space left")))
        got = np.zeros_like(big)
        work = p2p1.irecv(got, 0, tag=1)
        p2p0.isend(big, 1, tag=1).wait(TIMEOUT_S)  # our ring cannot be reserved: inline
        assert work.wait(TIMEOUT_S) and (got == big).all()
    got = np.zeros_like(big)
    work = p2p0.irecv(got, 1, tag=2)
    p2p1.isend(big + 1, 0, tag=2).wait(TIMEOUT_S)  # rank 1's ring to us: reserved
    assert work.wait(TIMEOUT_S) and (got == big + 1).all()
    assert 0 in e1._rings._used  # it came through the ring, not inline
