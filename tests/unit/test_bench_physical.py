"""``commrt bench --physical``'s raw TCP ring between ranks on different addresses: two "hosts"
on one machine, 127.0.0.1 and 127.0.0.2 (both loopback on Linux), each rank listening on its own."""
import socket
import threading

import pytest

from commrt.bench import physical
from commrt.runtime import store as store_mod
from commrt.runtime.errors import RendezvousError


class _Store:
    """set / wait as wait_for needs them, in memory, shared by the two rank threads."""

    def __init__(self):
        self.values, self.cond = {}, threading.Condition()

    def set(self, key, value):
        with self.cond:
            self.values[key] = value
            self.cond.notify_all()

    def wait(self, keys, abort_key, timeout_s):
        with self.cond:
            ok = self.cond.wait_for(lambda: all(k in self.values for k in keys), timeout_s)
            if not ok:
                return store_mod.TIMEOUT, [k for k in keys if k not in self.values]
            return store_mod.OK, [self.values[k] for k in keys]


def test_ranks_on_two_addresses_dial_each_other_not_themselves():
    """Each rank dialled its own bind address with the neighbour's port: over two nodes it
    connected to itself, or was refused (here: rank 1 on 127.0.0.1 dialled 127.0.0.1 at the
    port rank 0 listens on at 127.0.0.2)."""
    store, rings, errors = _Store(), {}, []
    hosts = {0: "127.0.0.2", 1: "127.0.0.1"}

    def rank(r):
        try:
            rings[r] = physical.TcpRing.open(store, r, 2, hosts[r], timeout_s=5.0)
        except Exception as exc:  # reported below, with the rank
            errors.append((r, exc))
    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    try:
        assert not errors, errors
        assert rings[1].out.getpeername()[0] == "127.0.0.2" and rings[0].out.getpeername()[0] == "127.0.0.1"
        rings[0].out.sendall(b"ping")
        assert rings[1].inp.recv(4) == b"ping"
    finally:
        for ring in rings.values():
            ring.close()


def _recording(monkeypatch, name):
    """socket.<name>, with every socket it returns kept in the list returned."""
    made, real = [], getattr(socket, name)

    def wrapper(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]
    monkeypatch.setattr(socket, name, wrapper)
    return made


def test_a_neighbour_that_never_publishes_leaves_no_listener_open(monkeypatch):
    # the listener stayed open (until the traceback was collected) when the right neighbour's
    # address never came: a rank whose neighbour died
    listeners = _recording(monkeypatch, "create_server")
    with pytest.raises(RendezvousError):
        physical.TcpRing.open(_Store(), 0, 2, "127.0.0.1", timeout_s=0.2)
    assert listeners and all(s.fileno() == -1 for s in listeners)


def test_a_left_neighbour_that_never_dials_leaves_no_socket_open(monkeypatch):
    # rank 0 dials rank 1 (a listener here that never dials back): accept times out, and the
    # connection out and the listener stayed open
    store, peer = _Store(), socket.create_server(("127.0.0.1", 0))
    try:
        store.set("tcp/addr/1", f"127.0.0.1:{peer.getsockname()[1]}".encode())
        listeners, dialled = _recording(monkeypatch, "create_server"), _recording(monkeypatch, "create_connection")
        with pytest.raises(OSError):
            physical.TcpRing.open(store, 0, 2, "127.0.0.1", timeout_s=0.2)
        assert listeners and dialled and all(s.fileno() == -1 for s in listeners + dialled)
    finally:
        peer.close()
