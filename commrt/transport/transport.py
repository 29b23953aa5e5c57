"""The one place a process's ZeroMQ machinery lives: ``Transport``.

Every socket commrt opens (the collectives' data plane, the rendezvous store, the parameter
server and its clients) is made here, so connection setup, authentication (``security.Guard``),
heartbeats, deadlines, frame limits and byte counters are decided once. ps-lite's single ``Van``
under its customers is the model.

Ownership rules (ZeroMQ sockets are not thread-safe):

- a socket has exactly one owner at a time: the thread that created it, or whoever holds the
  lock its component documents (a group's executor lock); it is never used by two threads at once;
- only the owner closes it, after its last use; ``Transport.close`` therefore runs only after
  every component has stopped its threads (``close`` of each component joins them first), and a
  component whose thread does not stop in time leaks its sockets rather than closing them under
  the thread (closing a socket another thread is blocked in aborts the process inside libzmq);
- blocking calls on these sockets wait in bounded slices (RCVTIMEO/SNDTIMEO), so an owner notices
  a cancellation or a deadline within a slice.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import zmq

from commrt.runtime import addresses
from commrt.runtime.config import Config
from commrt.transport.security import Guard

log = logging.getLogger(__name__)

SLICE_MS = 100  # longest a blocking socket call waits before its owner re-checks deadlines/cancel


@dataclass
class PeerCounters:
    """Bytes and messages moved with one peer (read by the bench, the tests and, later, the
    topology layer to tell intra- from inter-node traffic)."""
    sent_bytes: int = 0
    sent_msgs: int = 0
    recv_bytes: int = 0
    recv_msgs: int = 0


class Counters:
    """Per-peer counters keyed by peer name (``rank3``, ``server0``, ``store``). Each socket's
    owner updates its own peers' entries; reads are snapshots (approximate while ops run)."""

    def __init__(self) -> None:
        self._peers: dict[str, PeerCounters] = {}
        self._lock = threading.Lock()
        self._op_tables: list[dict] = []
        self._msg_tables: list[dict] = []
        self._fanouts: list[tuple[list[str], dict]] = []  # (peer names, fanout_table)
        self.same_node: list[bool] | None = None
        """Per global rank: on this rank's node? Set once the topology is known (bootstrap)."""

    def op_table(self, messages: bool = False) -> dict:
        """A new table of bytes (``messages``: of messages) sent, keyed ``(message kind, op code,
        peer name)``, for one endpoint. Only that endpoint's owner writes it (no lock on the send
        path); it outlives the endpoint so totals count since init."""
        table: dict = {}
        with self._lock:
            (self._msg_tables if messages else self._op_tables).append(table)
        return table

    def fanout_table(self, names: list[str]) -> dict:
        """A new table of what one endpoint sent to every one of ``names`` alike, keyed ``(message
        kind, op code)``, each a list [bytes per peer, messages per peer]: one update per op
        whatever the number of peers (a shared-memory step that every peer reads: seven peers
        at 8 ranks). Folded into the per-peer and per-op totals when they are read."""
        table: dict = {}
        with self._lock:
            self._fanouts.append((list(names), table))
        return table

    def _fanned(self) -> list[tuple[list[str], list[tuple[tuple, int, int]]]]:
        """Each fan-out table as (names, [(key, bytes, messages)]), copied (the caller holds _lock)."""
        return [(names, [(k, v[0], v[1]) for k, v in list(t.items())]) for names, t in self._fanouts]

    def sent_by_op(self, messages: bool = False) -> dict[tuple, int]:
        """Every endpoint's table summed (a snapshot: approximate while ops run)."""
        with self._lock:
            tables = [dict(t) for t in (self._msg_tables if messages else self._op_tables)]  # dict(): in C
            fanned = self._fanned()
        total: dict[tuple, int] = {}
        for t in tables:
            for k, v in t.items():
                total[k] = total.get(k, 0) + v
        for names, rows in fanned:
            for (kind, op), nbytes, msgs in rows:
                for name in names:
                    key = (kind, op, name)
                    total[key] = total.get(key, 0) + (msgs if messages else nbytes)
        return total

    def peer(self, name: str) -> PeerCounters:
        c = self._peers.get(name)
        if c is None:
            with self._lock:
                c = self._peers.setdefault(name, PeerCounters())
        return c

    def snapshot(self) -> dict[str, dict[str, int]]:
        with self._lock:
            out = {k: dict(vars(v)) for k, v in self._peers.items()}
            fanned = self._fanned()
        for names, rows in fanned:
            for name in names:
                c = out.setdefault(name, dict(vars(PeerCounters())))
                for _, nbytes, msgs in rows:
                    c["sent_bytes"] += nbytes
                    c["sent_msgs"] += msgs
        return out


class Transport:
    """One per process (or per runtime): the zmq.Context, the Guard, the socket factory and the
    counters. ``me`` is the name this process authenticates as (``rank0``, ``server1``)."""

    def __init__(self, cfg: Config, me: str):
        self.cfg, self.me = cfg, me
        self.ctx = zmq.Context()
        try:
            self.guard = Guard(self.ctx, cfg, me)  # before any socket binds
        except BaseException:
            self.ctx.destroy(linger=0)
            raise
        self.counters = Counters()
        self._heartbeat_ms = max(1, int(cfg.comm.heartbeat_s * 1000))
        self._closed = False

    # -- the socket factory -----------------------------------------------------------------
    def _tune(self, sock: zmq.Socket, max_frame: int | None, handshake_s: float) -> None:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.HEARTBEAT_IVL, self._heartbeat_ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * self._heartbeat_ms)
        sock.setsockopt(zmq.HANDSHAKE_IVL, max(1, int(handshake_s * 1000)))  # silent strangers drop
        if max_frame is not None:
            sock.setsockopt(zmq.MAXMSGSIZE, max_frame)

    def listen(self, kind: int, host: str, port: int = 0, *, max_frame: int | None = None,
               handshake_s: float | None = None) -> tuple[zmq.Socket, str]:
        """A socket that accepts authenticated peers on ``host`` (``port`` 0: any free one);
        returns it with the port it got as ``tcp://host:port``. Raises ``zmq.ZMQError``."""
        sock = self.ctx.socket(kind)
        try:
            self._tune(sock, max_frame, self.cfg.comm.timeout_s if handshake_s is None else handshake_s)
            self.guard.server(sock)
            if addresses.is_ipv6(host):
                sock.setsockopt(zmq.IPV6, 1)
            if port:
                sock.bind(addresses.tcp_url(host, port))
            else:
                port = sock.bind_to_random_port("tcp://" + addresses.url_host(host))
        except BaseException:
            sock.close(linger=0)
            raise
        return sock, addresses.tcp_url(host, port)

    def listen_local(self, kind: int, name: str, *, max_frame: int | None = None) -> tuple[zmq.Socket, str]:
        """Like ``listen``, on a Unix socket in the abstract namespace (``ipc://@name``: no
        file, gone with the process; reachable only from this host's network namespace), with
        the same authentication. Linux only."""
        sock = self.ctx.socket(kind)
        address = f"ipc://@{name}"
        try:
            self._tune(sock, max_frame, self.cfg.comm.timeout_s)
            self.guard.server(sock)
            sock.bind(address)
        except BaseException:
            sock.close(linger=0)
            raise
        return sock, address

    def dial(self, kind: int, address: str, peer: str, *, max_frame: int | None = None,
             send_slice_ms: int | None = SLICE_MS, handshake_s: float | None = None,
             before_connect=None) -> zmq.Socket:
        """A socket connected to ``address``, authenticating as us and (under CURVE) checking it
        is ``peer``. Sends wait at most ``send_slice_ms`` (a refused handshake leaves a socket
        with nowhere to queue: without the bound a send would block for ever)."""
        sock = self.ctx.socket(kind)
        try:
            self._tune(sock, max_frame, self.cfg.comm.timeout_s if handshake_s is None else handshake_s)
            if send_slice_ms is not None:
                sock.setsockopt(zmq.SNDTIMEO, send_slice_ms)
            self.guard.client(sock, peer)
            if before_connect is not None:  # e.g. a monitor, so it sees the first handshake
                before_connect(sock)
            if address.startswith("tcp://["):
                sock.setsockopt(zmq.IPV6, 1)
            sock.connect(address)
        except BaseException:
            sock.close(linger=0)
            raise
        return sock

    def inproc_pair(self, name: str) -> tuple[zmq.Socket, zmq.Socket]:
        """Two connected PAIR sockets (``inproc://``) for waking a socket-owning thread."""
        a, b = self.ctx.socket(zmq.PAIR), self.ctx.socket(zmq.PAIR)
        for s in (a, b):
            s.setsockopt(zmq.LINGER, 0)
        addr = f"inproc://commrt-{name}-{id(a):x}"
        a.bind(addr)
        b.connect(addr)
        return a, b

    def peer_of(self, frame: zmq.Frame) -> str | None:
        """The authenticated name of a received frame's sender (None without authentication)."""
        return self.guard.peer_of(frame)

    # -- lifetime -----------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, leaked_sockets: bool = False) -> None:
        """Stop authentication and end the context. Components close their own sockets first.
        ``leaked_sockets``: a component could not stop a thread that still owns a socket; then
        the context is left to the process's exit instead of being destroyed under it."""
        if self._closed:
            return
        self._closed = True
        self.guard.close()
        if leaked_sockets:
            log.warning("%s: a socket owner did not stop in time; leaving its sockets to process exit",
                        self.me)
            return
        self.ctx.destroy(linger=0)
