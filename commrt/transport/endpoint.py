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
from zmq.utils.monitor import recv_monitor_message

from ..errors import PeerLost, ProtocolError
from ..wire import ABORT, P2P, Header, decode_header, encode_header

log = logging.getLogger(__name__)

# Payloads from this size up are sent zero-copy (ZeroMQ reads our memory after send returns);
# smaller ones are copied. A zero-copy send costs a MessageTracker and a hop through pyzmq's
# garbage-collector thread when libzmq lets go of the buffer; below 1 MiB a memcpy is cheaper:
# 256 KiB all_reduce at n=2 went from 450 to 290 us (pyzmq's own threshold is 64 KiB).
ZERO_COPY_MIN_BYTES = 1 << 20
# read ahead for other (peer, channel) pairs before we call it a flood rather than a fast peer
MAX_STASHED, MAX_STASHED_BYTES = 1_000_000, 4 << 30


class Message(NamedTuple):
    header: Header
    payload: zmq.Frame


class Endpoint:
    """Sockets of one rank in one group. ``op``/``seq`` only label errors."""

    def __init__(self, ctx: zmq.Context, rank: int, bind_host: str, advertise_host: str,
                 max_frame_bytes: int, heartbeat_s: float, timeout_s: float, guard=None,
                 names: list[str] | None = None):
        self.rank = rank
        self.guard = guard  # security.Guard: CURVE keys and the sender check (None: plaintext)
        self.names = names or []  # group rank -> the key name that rank must send with
        self.timeout_s = timeout_s
        self._ctx = ctx
        self._max_frame = max_frame_bytes
        self._heartbeat_ms = int(heartbeat_s * 1000)
        self.inbound = ctx.socket(zmq.PULL)
        self._tune(self.inbound)
        self.inbound.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        if guard is not None:
            guard.server(self.inbound)
        port = self.inbound.bind_to_random_port(f"tcp://{bind_host}")
        self.address = f"tcp://{advertise_host or bind_host}:{port}"
        self._out: dict[int, zmq.Socket] = {}
        self.peer_addresses: dict[int, str] = {}
        self._stashed = self._stashed_bytes = 0
        self._stash: dict[tuple[int, int], collections.deque] = collections.defaultdict(collections.deque)
        self._trackers: list[tuple[int, zmq.MessageTracker]] = []
        self.dropped = 0  # malformed messages discarded (see ProtocolError handling)
        # liveness: a monitor on each outgoing connection reports when a peer's connection drops
        # (its process died, or it stopped answering ZMTP heartbeats: SIGSTOP, a hung host)
        self._monitors: dict[zmq.Socket, int] = {}
        self.down: dict[int, float] = {}  # peer -> when its connection dropped
        self._grace_s = heartbeat_s
        # recv blocks in libzmq (GIL released, no poll round trip: ~12 us less per message
        # than poll + non-blocking read) for at most this long between liveness/deadline checks
        self.inbound.setsockopt(zmq.RCVTIMEO, min(100, max(1, self._heartbeat_ms // 4)))

    def _tune(self, sock: zmq.Socket) -> None:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.HEARTBEAT_IVL, self._heartbeat_ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * self._heartbeat_ms)
        sock.setsockopt(zmq.HANDSHAKE_IVL, int(self.timeout_s * 1000))

    def connect(self, addresses: dict[int, str]) -> None:
        """Open a PUSH socket to every other member (peers are keyed by group rank)."""
        self.peer_addresses = dict(addresses)
        for peer, addr in addresses.items():
            if peer == self.rank or peer in self._out:
                continue
            sock = self._ctx.socket(zmq.PUSH)
            self._tune(sock)
            sock.setsockopt(zmq.SNDTIMEO, int(self.timeout_s * 1000))
            sock.setsockopt(zmq.IMMEDIATE, 0)
            if self.guard is not None:
                self.guard.client(sock, self.names[peer])
            mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
            self._monitors[mon] = peer
            sock.connect(addr)
            self._out[peer] = sock

    def _watch_peers(self) -> None:
        for mon, peer in self._monitors.items():
            while True:
                try:
                    event = recv_monitor_message(mon, zmq.NOBLOCK)["event"]
                except zmq.Again:
                    break
                if event == zmq.EVENT_DISCONNECTED:
                    self.down.setdefault(peer, time.monotonic())
                elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self.down.pop(peer, None)

    # -- sending ---------------------------------------------------------------------------
    def send(self, dst: int, header: Header, payload, op: str = "?") -> None:
        """Queue ``payload`` (bytes or a 1-D uint8 array) for ``dst`` without copying it.

        The caller must keep the memory unchanged until ``flush()`` returns: large payloads
        are read by ZeroMQ's I/O thread after this call has returned.
        """
        sock = self._out[dst]
        try:
            sock.send(encode_header(header), zmq.SNDMORE, copy=True)
            if len(payload) >= ZERO_COPY_MIN_BYTES:
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
            msg = stash.popleft()
            self._stashed -= 1
            self._stashed_bytes -= msg.header.nbytes
            return msg
        limit = self.timeout_s if timeout_s is None else timeout_s
        deadline, extended = time.monotonic() + limit, False
        while True:
            msg = self._read(0)  # blocks for at most RCVTIMEO
            if msg is None:
                self._watch_peers()
                now = time.monotonic()
                if src in self.down and now - self.down[src] > self._grace_s:
                    raise self._lost(src, op, seq, now)
                if now >= deadline:
                    if not self.down and not extended:
                        # nothing dropped yet: give the heartbeats time to name a frozen peer
                        # (3 missed intervals, then the grace) before blaming whoever we wait on
                        deadline, extended = now + 4 * self._grace_s, True
                        continue
                    raise self._timeout(src, op, seq, limit)
                continue
            h = msg.header
            if h.kind == ABORT:  # a peer gave up on a lost rank: so do we, naming the same rank
                raise PeerLost(h.op, op, seq, f"rank {h.src} reported it lost")
            got = (h.src, h.op if h.kind == P2P else -1)
            if got == key:
                return msg
            self._stash[got].append(msg)
            self._stashed += 1
            self._stashed_bytes += h.nbytes
            if self._stashed > MAX_STASHED or self._stashed_bytes > MAX_STASHED_BYTES:
                self._stash.clear()
                self._stashed = self._stashed_bytes = 0
                raise ProtocolError(f"rank {self.rank}: more than {MAX_STASHED} messages or "
                                    f"{MAX_STASHED_BYTES >> 30} GiB arrived that no operation asked for "
                                    f"(last from rank {h.src}); refusing to buffer more")

    def tell_peers_lost(self, culprit: int, group: int, seq: int) -> None:
        """Best effort, never blocking: tell every other peer which rank we lost, so that ranks
        waiting elsewhere in the ring name it too instead of us when we leave."""
        h = encode_header(Header(ABORT, group, seq, self.rank, culprit, 0, 0, 0, 0))
        for peer, sock in self._out.items():
            if peer != culprit:
                try:
                    sock.send_multipart([h, b""], zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass

    def _lost(self, src: int, op: str, seq: int, now: float) -> PeerLost:
        """``src`` is gone. If another peer dropped shortly before, that one went first and
        ``src`` most likely gave up because of it (a survivor that raised and exited): name it."""
        recent = {p: t for p, t in self.down.items() if now - t <= self.timeout_s}
        first = min(recent, key=recent.get) if recent else src
        why = "process ended, or stopped answering heartbeats"
        if first == src:
            return PeerLost(src, op, seq, f"connection lost {now - self.down[src]:.2f}s ago ({why})")
        return PeerLost(first, op, seq, f"connection lost {now - self.down[first]:.2f}s ago ({why}); "
                        f"rank {src}, which this rank was waiting on, dropped after it")

    def _timeout(self, src: int, op: str, seq: int, limit: float) -> PeerLost:
        """Nothing from ``src`` in time: if another peer's connection dropped, that rank is the
        likelier culprit (we wait on a neighbour that waits on it), so name it."""
        gone = sorted(self.down, key=self.down.get)
        if gone:
            return PeerLost(gone[0], op, seq, f"no message from rank {src} within {limit:g}s, and rank "
                            f"{gone[0]}'s connection was lost {time.monotonic() - self.down[gone[0]]:.2f}s ago")
        return PeerLost(src, op, seq, f"no message within {limit:g}s")

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
            if self.guard is not None and self.guard.active:
                sender = self.guard.peer_of(frames[0])
                claimed = self.names[header.src] if header.src < len(self.names) else f"rank index {header.src}"
                if sender != claimed:
                    raise ProtocolError(f"a message claiming to be from {claimed} came over {sender}'s key")
        except ProtocolError as exc:
            self.dropped += 1
            log.warning("rank %d dropped a malformed message (%d so far): %s", self.rank, self.dropped, exc)
            return None
        return Message(header, frames[1])

    def close(self) -> None:
        for mon in self._monitors:
            mon.close(linger=0)
        self._monitors.clear()
        for sock in self._out.values():
            sock.close(linger=0)
        self.inbound.close(linger=0)
        self._out.clear()
        self._stash.clear()
        self._trackers.clear()
