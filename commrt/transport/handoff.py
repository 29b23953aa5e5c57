"""Handing shared-memory segments to the node's peers as file descriptors (issue 30.1).

Each rank listens on a Unix socket in the abstract namespace (no file anywhere: the name goes
with the process, and with it every way in) named by 128 random bits, which travel in the
group's address exchange. A peer connects, and before any descriptor crosses:

1. both ends check the other's uid (SO_PEERCRED): another user never gets further;
2. the server sends a fresh 32-byte challenge; the client answers with its group rank, its own
   challenge and HMAC-SHA256(job secret, "client" | socket name | both challenges | rank);
3. the server checks the answer in constant time and that the rank is a peer still owed its
   descriptors, then sends HMAC(job secret, "server" | ...) with the descriptors (SCM_RIGHTS);
   the client keeps them only if that proof checks out, so it never maps a stranger's memory.

A process without the secret gets a refusal and nothing else; the secret itself never crosses.
Without a secret (security mode 'none', and 'curve', whose keys give no shared secret here) the
HMAC key is empty: then the uid check is the whole guarantee, as 'none' is on the TCP path.

Every wait has the caller's deadline and calls ``watch`` (which raises PeerLost for a peer the
group's liveness found dead) once a slice; a peer whose socket is gone or that hangs up
mid-handshake is a PeerLost naming it at once.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import selectors
import socket
import struct
import threading
import time
from typing import Callable

from commrt.runtime.errors import PeerLost, ProtocolError

log = logging.getLogger(__name__)

HELLO = b"cmshm1\0\0"
NONCE = 32
_ANSWER = struct.Struct(f"<8sI{NONCE}s32s")  # hello, client rank, client challenge, client proof
REFUSED = b"refused"
MAX_FDS = 8
SLICE_S = 0.05
HANDSHAKE_S = 10.0  # a connection that has not answered its challenge by then is dropped
_CRED = struct.Struct("3i")  # pid, uid, gid

Watch = Callable[[list], None]  # raises PeerLost when one of these peers is known dead


def proof(key: bytes, side: bytes, name: str, ns: bytes, nc: bytes, rank: int) -> bytes:
    msg = b"|".join([side, name.encode(), ns, nc, str(rank).encode()])
    return hmac.new(key, msg, hashlib.sha256).digest()


def peer_uid(sock: socket.socket) -> int:
    return _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))[1]


def _close_fds(fds) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


class Handoff:
    """This rank's listening socket; ``exchange`` serves and fetches every peer's descriptors."""

    def __init__(self) -> None:
        self.name = f"commrt-{secrets.token_hex(16)}"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            self._sock.bind("\0" + self.name)
            self._sock.listen(64)
            self._sock.setblocking(False)
        except BaseException:
            self._sock.close()
            raise

    def exchange(self, key: bytes, rank: int, gives: dict[int, list[int]], addresses: dict[int, str],
                 deadline: float, watch: Watch) -> dict[int, list[int]]:
        """Give ``gives[p]`` to each peer p and fetch from each the descriptors it gives us (at
        ``addresses[p]``); returns them per peer. Raises PeerLost naming a peer that is gone or
        silent past ``deadline``, ProtocolError for one that fails the handshake."""
        server = _Server(self._sock, self.name, key, gives, deadline)
        thread = threading.Thread(target=server.run, name="commrt-shm-handoff", daemon=True)
        thread.start()
        got: dict[int, list[int]] = {}
        try:
            for p in sorted(addresses):
                got[p] = fetch(addresses[p], key, rank, p, deadline, watch)
            while thread.is_alive():
                thread.join(SLICE_S)
                waiting = sorted(server.pending)
                if waiting and time.monotonic() >= deadline:
                    raise PeerLost(waiting[0], "connect", 0, "did not fetch our shared-memory segment "
                                   "before the deadline")
                watch(waiting)
            if server.pending:
                raise PeerLost(min(server.pending), "connect", 0, "did not fetch our shared-memory segment")
        except BaseException:
            for fds in got.values():
                _close_fds(fds)
            raise
        finally:
            server.stop.set()
            thread.join()
        return got

    def close(self) -> None:
        self._sock.close()


class _Server:
    """The listening side of one exchange, on its own thread (our fetches run meanwhile)."""

    def __init__(self, listener: socket.socket, name: str, key: bytes, gives: dict[int, list[int]],
                 deadline: float):
        self._listener, self._name, self._key, self._gives = listener, name, key, gives
        self._deadline = deadline
        self.pending = set(gives)
        self.stop = threading.Event()

    def run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ)
        conns: dict[socket.socket, tuple[bytes, float]] = {}  # challenge sent, when
        try:
            while self.pending and not self.stop.is_set() and time.monotonic() < self._deadline:
                for k, _ in sel.select(SLICE_S):
                    if k.fileobj is self._listener:
                        self._accept(sel, conns)
                    else:
                        self._answer(sel, conns, k.fileobj)
                now = time.monotonic()
                for conn in [c for c, (_, t) in conns.items() if now - t > HANDSHAKE_S]:
                    self._drop(sel, conns, conn)
        finally:
            for conn in list(conns):
                self._drop(sel, conns, conn)
            sel.close()

    def _accept(self, sel, conns) -> None:
        try:
            conn, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        conn.setblocking(False)
        if peer_uid(conn) != os.getuid():
            log.warning("shared-memory handoff: refused a connection from another user")
            conn.close()
            return
        challenge = secrets.token_bytes(NONCE)
        try:
            conn.send(HELLO + challenge)
        except OSError:
            conn.close()
            return
        conns[conn] = (challenge, time.monotonic())
        sel.register(conn, selectors.EVENT_READ)

    def _answer(self, sel, conns, conn: socket.socket) -> None:
        challenge, _ = conns[conn]
        try:
            msg = conn.recv(256)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            msg = b""
        rank = self._verify(msg, challenge)
        try:
            if rank is None:
                if msg:
                    log.warning("shared-memory handoff: refused a peer that did not prove the job secret")
                    conn.send(REFUSED)
            else:
                nc = msg[len(HELLO) + 4:len(HELLO) + 4 + NONCE]
                socket.send_fds(conn, [proof(self._key, b"server", self._name, challenge, nc, rank)],
                                self._gives[rank])
                self.pending.discard(rank)
        except OSError:
            pass
        self._drop(sel, conns, conn)

    def _verify(self, msg: bytes, challenge: bytes) -> int | None:
        """The group rank the answer proves, when it is one still owed its descriptors."""
        if len(msg) != _ANSWER.size:
            return None
        hello, rank, nc, mac = _ANSWER.unpack(msg)
        want = proof(self._key, b"client", self._name, challenge, nc, rank)
        if hello != HELLO or not hmac.compare_digest(mac, want) or rank not in self.pending:
            return None
        return rank

    @staticmethod
    def _drop(sel, conns, conn) -> None:
        conns.pop(conn, None)
        try:
            sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()


def fetch(address: str, key: bytes, rank: int, peer: int, deadline: float, watch: Watch) -> list[int]:
    """Connect to ``peer``'s handoff socket, prove the secret, check its proof; its descriptors."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        # a full backlog (a frozen peer never accepting, or a flood) blocks connect(): bounded too
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            sock.connect("\0" + address)
        except (ConnectionRefusedError, FileNotFoundError):
            raise PeerLost(peer, "connect", 0, "its shared-memory socket is gone (process ended or gave "
                           "up setup)") from None
        except (socket.timeout, BlockingIOError):
            raise PeerLost(peer, "connect", 0, "its shared-memory socket took no connection before the "
                           "deadline") from None
        if peer_uid(sock) != os.getuid():
            raise ProtocolError(f"rank {peer}'s shared-memory socket belongs to another user")
        hello, stray = _recv(sock, peer, deadline, watch)
        _close_fds(stray)
        if len(hello) != len(HELLO) + NONCE or not hello.startswith(HELLO):
            raise ProtocolError(f"rank {peer} sent a malformed shared-memory handshake")
        ns, nc = hello[len(HELLO):], secrets.token_bytes(NONCE)
        sock.send(_ANSWER.pack(HELLO, rank, nc, proof(key, b"client", address, ns, nc, rank)))
        reply, fds = _recv(sock, peer, deadline, watch)
        if reply == REFUSED:
            raise ProtocolError(f"rank {peer} refused our shared-memory handshake: this process does not "
                                "hold the job secret the peer holds (check COMMRT_JOB_SECRET)")
        if not hmac.compare_digest(reply, proof(key, b"server", address, ns, nc, rank)):
            _close_fds(fds)
            raise ProtocolError(f"rank {peer}'s shared-memory socket did not prove the job secret")
        return fds
    finally:
        sock.close()


def _recv(sock: socket.socket, peer: int, deadline: float, watch: Watch) -> tuple[bytes, list[int]]:
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise PeerLost(peer, "connect", 0, "no answer on its shared-memory socket before the deadline")
        sock.settimeout(min(SLICE_S, left))
        try:
            msg, fds, flags, _ = socket.recv_fds(sock, 256, MAX_FDS)
        except socket.timeout:
            watch([peer])
            continue
        except OSError as exc:
            raise PeerLost(peer, "connect", 0, f"its shared-memory socket failed: {exc}") from None
        if flags & socket.MSG_CTRUNC:
            _close_fds(fds)
            raise ProtocolError(f"rank {peer} sent more descriptors than a segment handoff carries")
        if not msg and not fds:
            raise PeerLost(peer, "connect", 0, "hung up during the shared-memory handshake")
        return msg, fds
