"""The shared-memory handoff (transport/handoff.py) in one process: descriptors reach a peer
that proves the job secret, never one that does not, and a gone or silent peer is a PeerLost
naming it within the deadline (issue 30.1)."""
import os
import threading
import time

import pytest

from commrt.runtime.errors import PeerLost, ProtocolError
from commrt.transport import handoff

KEY = b"the job secret, 32 bytes long..."


def _memfds(n):
    return [os.memfd_create(f"t{i}") for i in range(n)]


def _run(h, key, rank, gives, addresses, out, deadline_s=10.0):
    try:
        out[rank] = h.exchange(key, rank, gives, addresses, time.monotonic() + deadline_s, lambda w: None)
    except BaseException as exc:  # handed to the test
        out[rank] = exc


def _same_file(a, b):
    sa, sb = os.fstat(a), os.fstat(b)
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def test_two_secret_holders_swap_descriptors():
    a, b = handoff.Handoff(), handoff.Handoff()
    fa, fb, out = _memfds(2), _memfds(2), {}
    try:
        t = threading.Thread(target=_run, args=(b, KEY, 1, {0: fb}, {0: a.name}, out))
        t.start()
        _run(a, KEY, 0, {1: fa}, {1: b.name}, out)
        t.join()
        assert all(_same_file(x, y) for x, y in zip(out[0][1], fb)), out
        assert all(_same_file(x, y) for x, y in zip(out[1][0], fa)), out
    finally:
        a.close(), b.close()
        for fd in [*fa, *fb, *(fd for got in out.values() if isinstance(got, dict) for v in got.values() for fd in v)]:
            os.close(fd)


@pytest.mark.parametrize("guess", [b"", b"not the job secret"])
def test_a_process_without_the_secret_is_refused_and_the_peer_still_served(guess):
    a, fa, out = handoff.Handoff(), _memfds(1), {}
    try:
        t = threading.Thread(target=_run, args=(a, KEY, 0, {1: fa}, {}, out))
        t.start()
        with pytest.raises(ProtocolError, match="refused"):
            handoff.fetch(a.name, guess, 1, 0, time.monotonic() + 5, lambda w: None)
        got = handoff.fetch(a.name, KEY, 1, 0, time.monotonic() + 5, lambda w: None)  # the real rank 1
        t.join()
        assert out[0] == {} and len(got) == 1 and _same_file(got[0], fa[0])
        os.close(got[0])
    finally:
        a.close()
        os.close(fa[0])


def test_a_gone_peer_is_a_peer_lost_naming_it():
    with pytest.raises(PeerLost, match="rank 3 .*socket is gone"):
        handoff.fetch("commrt-" + "0" * 32, KEY, 0, 3, time.monotonic() + 5, lambda w: None)


def test_a_peer_that_never_fetches_is_a_peer_lost_at_the_deadline():
    a, fa, out = handoff.Handoff(), _memfds(1), {}
    try:
        start = time.monotonic()
        _run(a, KEY, 0, {2: fa}, {}, out, deadline_s=0.5)
        assert isinstance(out[0], PeerLost) and "rank 2" in str(out[0]), out
        assert time.monotonic() - start < 3
    finally:
        a.close()
        os.close(fa[0])


def test_a_peer_whose_socket_takes_no_connection_is_a_peer_lost_at_the_deadline():
    """A peer's listening socket with a full backlog (a frozen peer that never accepts, or one
    flooded with connections) makes connect() block: fetch must end at its deadline all the same."""
    import socket
    name = f"commrt-test-{os.getpid()}-{time.monotonic_ns()}"
    full = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    full.bind("\0" + name)
    full.listen(0)
    queued = []
    try:
        while True:  # fill the backlog
            c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            c.setblocking(False)
            queued.append(c)
            try:
                c.connect("\0" + name)
            except BlockingIOError:
                break
        out = {}

        def fetch():
            try:
                out["got"] = handoff.fetch(name, KEY, 0, 4, time.monotonic() + 0.5, lambda w: None)
            except BaseException as exc:
                out["got"] = exc
        t = threading.Thread(target=fetch, daemon=True)
        t.start()
        t.join(5.0)
        assert not t.is_alive(), "fetch still blocks in connect"
        assert isinstance(out["got"], PeerLost) and out["got"].rank == 4, out
    finally:
        for c in queued:
            c.close()
        full.close()
