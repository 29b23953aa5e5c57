"""One group's data-plane sockets: a PULL socket bound locally and a PUSH socket per peer.

An Endpoint has one owner thread at a time (the group's executor holds its lock), which is
what ZeroMQ requires of sockets. Messages from one peer arrive in the order they were sent
(ZeroMQ keeps per-pipe order); messages from different peers interleave, so ``recv(src)``
stashes what it reads for other peers until they are asked for.
"""
from __future__ import annotations

import collections
import logging
import time
from typing import NamedTuple

import zmq

from ..errors import PeerLost, ProtocolError
from ..wire import P2P, Header, decode_header, encode_header

log = logging.getLogger(__name__)

# pyzmq copies frames below this size even when asked not to; above it, it sends our memory.
_COPY_THRESHOLD = zmq.COPY_THRESHOLD


class Message(NamedTuple):
    header: Header
    payload: zmq.Frame


class Endpoint:
    """Sockets of one rank in one group. ``op``/``seq`` only label errors."""

    def __init__(self, ctx: zmq.Context, rank: int, bind_host: str, advertise_host: str,
                 max_frame_bytes: int, heartbeat_s: float, timeout_s: float):
        self.rank = rank
        self.timeout_s = timeout_s
        self._ctx = ctx
        self._max_frame = max_frame_bytes
        self._heartbeat_ms = int(heartbeat_s * 1000)
        self.inbound = ctx.socket(zmq.PULL)
        self._tune(self.inbound)
        self.inbound.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        port = self.inbound.bind_to_random_port(f"tcp://{bind_host}")
        self.address = f"tcp://{advertise_host or bind_host}:{port}"
        self._out: dict[int, zmq.Socket] = {}
        self._stash: dict[tuple[int, int], collections.deque] = collections.defaultdict(collections.deque)
        self._trackers: list[tuple[int, zmq.MessageTracker]] = []
        self.dropped = 0  # malformed messages discarded (see ProtocolError handling)

    def _tune(self, sock: zmq.Socket) -> None:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.HEARTBEAT_IVL, self._heartbeat_ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * self._heartbeat_ms)
        sock.setsockopt(zmq.HANDSHAKE_IVL, int(self.timeout_s * 1000))

    def connect(self, addresses: dict[int, str]) -> None:
        """Open a PUSH socket to every other member (peers are keyed by group rank)."""
        for peer, addr in addresses.items():
            if peer == self.rank or peer in self._out:
                continue
            sock = self._ctx.socket(zmq.PUSH)
            self._tune(sock)
            sock.setsockopt(zmq.SNDTIMEO, int(self.timeout_s * 1000))
            sock.setsockopt(zmq.IMMEDIATE, 0)
            sock.connect(addr)
            self._out[peer] = sock

    # -- sending ---------------------------------------------------------------------------
    def send(self, dst: int, header: Header, payload, op: str = "?") -> None:
        """Queue ``payload`` (bytes or a 1-D uint8 array) for ``dst`` without copying it.

        The caller must keep the memory unchanged until ``flush()`` returns: large payloads
        are read by ZeroMQ's I/O thread after this call has returned.
        """
        sock = self._out[dst]
        try:
            sock.send(encode_header(header), zmq.SNDMORE, copy=True)
            if len(payload) >= _COPY_THRESHOLD:
                tracker = sock.send(payload, copy=False, track=True)
                self._trackers.append((dst, tracker))
            else:
                sock.send(payload, copy=True)
        except zmq.Again:
            raise PeerLost(dst, op, header.seq, f"could not send within {self.timeout_s:g}s "
                           "(peer not draining its socket)") from None

    def flush(self, op: str = "?", seq: int = 0) -> None:
        """Wait until ZeroMQ no longer needs any buffer handed to ``send``."""
        deadline = time.monotonic() + self.timeout_s
        for dst, tracker in self._trackers:
            remaining = deadline - time.monotonic()
            try:
                tracker.wait(max(remaining, 0.0))
            except zmq.NotDone:
                raise PeerLost(dst, op, seq, "send not drained before the deadline") from None
        self._trackers.clear()

    # -- receiving -------------------------------------------------------------------------
    def recv(self, src: int, tag: int = -1, op: str = "?", seq: int = 0,
             timeout_s: float | None = None) -> Message:
        """Next message from ``src`` (in send order) on channel ``tag`` (a point-to-point
        tag; -1 for collectives), within the deadline."""
        key = (src, tag)
        stash = self._stash.get(key)
        if stash:
            return stash.popleft()
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        while True:
            msg = self._read(zmq.NOBLOCK)
            if msg is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise PeerLost(src, op, seq, f"no message within {self.timeout_s:g}s")
                self.inbound.poll(max(1, int(remaining * 1000) + 1))
                continue
            h = msg.header
            got = (h.src, h.op if h.kind == P2P else -1)
            if got == key:
                return msg
            self._stash[got].append(msg)

    def _read(self, flags: int) -> Message | None:
        try:
            frames = self.inbound.recv_multipart(flags, copy=False)
        except zmq.Again:
            return None
        try:
            if len(frames) != 2:
                raise ProtocolError(f"expected 2 frames (header, payload), got {len(frames)}")
            header = decode_header(frames[0].bytes)
            if header.nbytes != len(frames[1]):
                raise ProtocolError(f"header says {header.nbytes} payload bytes, frame has {len(frames[1])}")
        except ProtocolError as exc:
            self.dropped += 1
            log.warning("rank %d dropped a malformed message (%d so far): %s", self.rank, self.dropped, exc)
            return None
        return Message(header, frames[1])

    def close(self) -> None:
        for sock in self._out.values():
            sock.close(linger=0)
        self.inbound.close(linger=0)
        self._out.clear()
        self._stash.clear()
        self._trackers.clear()
