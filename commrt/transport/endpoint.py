"""One group's data-plane sockets: a PULL socket bound locally and a PUSH socket per peer,
made by the process's ``Transport`` and dialled lazily, on the first send to or receive from a
peer, so a rank holds connections only to the peers its algorithms talk to.

An Endpoint has one owner at a time (transport.py's ownership rules): the holder of the group executor's turn
for collectives, the point-to-point engine's thread for point-to-point. Another thread may only
``cancel()`` it; the owner notices within one receive slice and raises ``GroupClosed``.
Messages from one peer arrive in send order (ZeroMQ keeps per-pipe order); messages from
different peers interleave, so ``recv(src)`` stashes what it reads for other peers, within a
bound the owner sets from what its operations can legitimately be sent ahead.
"""
from __future__ import annotations

import collections
import logging
import time

import zmq

from commrt.runtime import addresses
from commrt.runtime.errors import GroupClosed, OpRefused, PeerLost, ProtocolError
from commrt.transport import notices
from commrt.transport.liveness import Liveness
from commrt.transport.messages import Message, MismatchReport, decode_report, encode_report
from commrt.transport.notices import is_goodbye
from commrt.transport.wire import ABORT, P2P, REFUSE, Header, decode_header, encode_header
from commrt.transport.transport import SLICE_MS, Transport

__all__ = ["Endpoint", "is_goodbye", "Message", "MismatchReport", "decode_report", "encode_report", "ZERO_COPY_MIN_BYTES"]

log = logging.getLogger(__name__)

# Payloads from this size up are sent zero-copy (ZeroMQ reads our memory after send returns);
# smaller ones are copied. A zero-copy send costs a MessageTracker and a hop through pyzmq's
# garbage-collector thread when libzmq lets go of the buffer; below 1 MiB a memcpy is cheaper:
# 256 KiB all_reduce at n=2 went from 450 to 290 us (pyzmq's own threshold is 64 KiB).
ZERO_COPY_MIN_BYTES = 1 << 20
HWM = 100_000  # messages per pipe: deep enough that ring pipelines never wait on ZeroMQ
# At close, a PUSH socket gets this long to deliver what was handed to it: an op is complete
# once its small payloads are queued, and a connection dialled lazily for the last op of a job
# may still be in its handshake when the process leaves (LINGER 0 would drop the message, and
# the peer would wait for it in vain). Bounded, so a dead peer delays exit by at most this.
CLOSE_LINGER_MS = 1000
KEPT_REFUSALS = 64  # refused operations an endpoint remembers (its own, and peers' ahead of it)


class Endpoint:
    """Sockets of one rank in one group. ``op``/``seq`` only label errors."""

    def __init__(self, transport: Transport, group: int, rank: int, names: list[str],
                 bind_host: str, advertise_host: str, max_frame_bytes: int, heartbeat_s: float,
                 timeout_s: float):
        self.transport, self.group, self.rank, self.names = transport, group, rank, names
        self.timeout_s = timeout_s
        self._max_frame = max_frame_bytes
        self.inbound, bound = transport.listen(zmq.PULL, bind_host, max_frame=max_frame_bytes)
        self.inbound.setsockopt(zmq.RCVHWM, HWM)
        # recv blocks in libzmq (GIL released, no poll round trip: ~12 us less per message
        # than poll + non-blocking read) for at most this long between liveness/deadline checks
        self._slice_s = min(SLICE_MS, max(1, int(heartbeat_s * 1000) // 4)) / 1000
        self.inbound.setsockopt(zmq.RCVTIMEO, int(self._slice_s * 1000))
        self.address = addresses.tcp_url(advertise_host or bind_host, bound.rsplit(":", 1)[1])
        self.peer_addresses: dict[int, str] = {}
        self._resolve = None  # (peers, op, lost) -> {peer: address}: addresses learnt on first use
        self._out: dict[int, zmq.Socket] = {}
        self._counters = [transport.counters.peer(n) for n in names]
        self._op_sent = transport.counters.op_table()
        self._op_msgs = transport.counters.op_table(messages=True)
        self._fanout = transport.counters.fanout_table([n for p, n in enumerate(names) if p != rank])
        self._stash: dict[tuple[int, int], collections.deque] = collections.defaultdict(collections.deque)
        self._ahead = [[0, 0] for _ in names]  # per peer: messages, bytes stashed
        self.ahead_limit = (1 << 10, 64 << 20)  # (messages, bytes) per peer; the owner sets it per op
        self._trackers: list[tuple[int, zmq.MessageTracker]] = []
        self.dropped = 0  # malformed messages discarded (see ProtocolError handling)
        self.last: Header | None = None  # header of the last message recv() returned
        self.cancelled = False  # set by another thread: the owner raises GroupClosed
        self._grace_s = heartbeat_s
        self.live = Liveness(self._slice_s, heartbeat_s, timeout_s)  # which peers are gone
        self.down = self.live.down  # peer -> when its connection dropped
        self.refused_here: dict[int, tuple[int, str]] = {}  # seq -> (collective, reason) this rank refused
        # a peer's refusal of, or mismatch report at, an op this rank has not started
        self.refusals: dict[int, OpRefused | MismatchReport] = {}

    def connect(self, addresses: dict[int, str], resolve=None) -> None:
        """Learn members' addresses (keyed by group rank); sockets are dialled on first use.
        ``resolve(peers, op, lost)``: where the others' come from when first needed (the world's
        rendezvous reads a peer's hello then, issue 32.5); it raises a typed error naming them."""
        self.peer_addresses = dict(addresses)
        self._resolve = resolve

    def socket_to(self, peer: int, op: str = "a send or receive", watch: bool = True) -> zmq.Socket:
        """The PUSH socket to ``peer``, dialled now if this is the first use. ``watch`` False: no
        liveness monitor on a new socket (a notice to every peer of a group that is unusable
        from then on: no wait will read that peer's liveness, and the monitor was most of the
        dial's cost, ``notices.tell_peers``)."""
        sock = self._out.get(peer)
        if sock is not None:
            return sock
        address = self.peer_addresses.get(peer)
        if address is None and self._resolve is not None and peer != self.rank and 0 <= peer < len(self.names):
            address = self.peer_addresses[peer] = self._resolve([peer], op, None)[peer]
        if peer == self.rank or address is None:
            raise ValueError(f"rank {self.rank}: no address for peer rank {peer}")
        sock = self.transport.dial(zmq.PUSH, address, self.names[peer], max_frame=self._max_frame)
        sock.setsockopt(zmq.SNDHWM, HWM)
        if watch:
            self.live.monitor(sock, peer)
        self._out[peer] = sock
        return sock

    def all_peers(self, op: str, lost: int | None = None) -> list[int]:
        """Every other member, their addresses learnt first (the unknown ones in one request):
        for the paths that reach every peer (abort notices, a receive from any source)."""
        missing = [p for p in range(len(self.names)) if p != self.rank and p not in self.peer_addresses]
        if missing and self._resolve is not None:
            self.peer_addresses.update(self._resolve(missing, op, lost))
        return [p for p in self.peer_addresses if p != self.rank]

    def count_sent(self, dst: int, kind: int, op: int, nbytes: int) -> None:
        """Account ``nbytes`` sent to ``dst`` in the transport's counters (per peer, and per
        (kind, op code, peer) for comm_stats' by-op table). Shared memory and the p2p rings
        count what their peers read here too, as if it had gone over the socket."""
        c = self._counters[dst]
        c.sent_bytes += nbytes
        c.sent_msgs += 1
        key = (kind, op & 0xFF, self.names[dst])
        self._op_sent[key] = self._op_sent.get(key, 0) + nbytes
        self._op_msgs[key] = self._op_msgs.get(key, 0) + 1

    def count_sent_to_all(self, kind: int, op: int, nbytes: int) -> None:
        """``count_sent`` for every peer of the group, in one update whatever their number
        (Counters.fanout_table): what every peer of a shared-memory step reads."""
        key = (kind, op & 0xFF)
        row = self._fanout.get(key)
        if row is None:
            row = self._fanout[key] = [0, 0]
        row[0] += nbytes
        row[1] += 1

    def watch_peers(self) -> None:
        self.live.watch()

    def cancel(self) -> None:
        """From any thread: make the owner give up its current wait within one slice."""
        self.cancelled = True

    def _closed(self, op: str, seq: int) -> GroupClosed:
        return GroupClosed(self.group, op, seq)

    # -- sending ---------------------------------------------------------------------------
    def send(self, dst: int, header: Header, payload, op: str = "?") -> None:
        """Queue ``payload`` (bytes or a 1-D uint8 array) for ``dst`` without copying it.

        The caller must keep the memory unchanged until ``flush()`` returns: large payloads
        are read by ZeroMQ's I/O thread after this call has returned.
        """
        sock = self._out.get(dst) or self.socket_to(dst, op)
        try:
            sock.send(encode_header(header), zmq.SNDMORE, copy=True)
        except zmq.Again:  # the peer is not draining: wait in slices, within the deadline
            self._send_slowly(sock, dst, encode_header(header), op, header.seq)
        n = len(payload)
        if n >= ZERO_COPY_MIN_BYTES:
            self._trackers.append((dst, sock.send(payload, copy=False, track=True)))
        else:
            sock.send(payload, copy=True)
        self.count_sent(dst, header.kind, header.op, n)

    def _send_slowly(self, sock: zmq.Socket, dst: int, head: bytes, op: str, seq: int) -> None:
        deadline = time.monotonic() + self.timeout_s
        while True:
            now = self._while_sending(dst, op, seq)
            if now >= deadline:
                raise PeerLost(dst, op, seq, f"could not send within {self.timeout_s:g}s "
                               "(peer not draining its socket)")
            try:
                sock.send(head, zmq.SNDMORE, copy=True)  # a multipart message passes the HWM whole
                return
            except zmq.Again:
                continue

    def flush(self, op: str = "?", seq: int = 0) -> None:
        """Wait until ZeroMQ no longer needs any buffer handed to ``send``."""
        deadline = time.monotonic() + self.timeout_s
        for dst, tracker in self._trackers:
            while not tracker.done:
                remaining = deadline - self._while_sending(dst, op, seq)
                if remaining <= 0:
                    raise PeerLost(dst, op, seq, "send not drained before the deadline")
                try:
                    tracker.wait(min(remaining, self._slice_s))
                except zmq.NotDone:
                    pass
        self._trackers.clear()

    def _while_sending(self, dst: int, op: str, seq: int) -> float:
        """Once a slice of a send that waits on ``dst``: what a receive checks. A frozen ``dst``
        never drains what we handed it, so without this the sender alone waited out the whole
        op timeout (300 s) while the ranks that receive named the lost rank within a second or
        two; a peer's ABORT notice is read too, and what else arrived is kept for later.
        Returns the time now."""
        if self.cancelled:
            raise self._closed(op, seq)
        now = time.monotonic()
        if self.live.watch_if_due(now) and self.live.is_lost(dst, now):
            raise self.live.lost(dst, op, seq, now)
        while (msg := self._read(zmq.NOBLOCK)) is not None:
            h = msg.header
            if h.kind == ABORT:
                notices.aborted(self, msg, op, seq)  # raises, unless it drops a malformed report
                continue
            if h.kind == REFUSE:
                notices.refused(self, msg, op, seq)
                continue
            if self.refused_here and self._stale(h):
                continue
            self._keep((h.src, h.op if h.kind == P2P else -1), msg, op, seq)
        return now

    # -- receiving -------------------------------------------------------------------------
    def recv(self, src: int, tag: int = -1, op: str = "?", seq: int = 0,
             timeout_s: float | None = None) -> Message:
        """Next message from ``src`` (in send order) on channel ``tag`` (-1: collectives),
        within the deadline. The deadline, cancellation and (once a slice) the peers'
        liveness are checked on every iteration, so messages from busy peers cannot keep a
        wait on a silent one alive."""
        key = (src, tag)
        stash = self._stash.get(key)
        if stash:
            msg = stash.popleft()
            ahead = self._ahead[src]
            ahead[0] -= 1
            ahead[1] -= msg.header.nbytes
            self.last = msg.header
            return msg
        if src not in self._out:  # dial the peer we wait on: its connection's monitor is our liveness
            self.socket_to(src, op)
        limit = self.timeout_s if timeout_s is None else timeout_s
        deadline, extended = time.monotonic() + limit, False
        while True:
            msg = self._read(0)  # blocks for at most one slice
            now = time.monotonic()
            if self.cancelled:
                raise self._closed(op, seq)
            if msg is not None:
                h = msg.header
                got = (h.src, h.op if h.kind == P2P else -1)
                if h.kind == ABORT:
                    notices.aborted(self, msg, op, seq)  # raises, unless a goodbye or a malformed report
                elif h.kind == REFUSE:
                    notices.refused(self, msg, op, seq)  # raises, unless no news for this op
                elif self.refused_here and self._stale(h):
                    pass
                elif got == key:
                    self.last = h
                    return msg
                else:
                    self._keep(got, msg, op, seq)
            if self.live.watch_if_due(now) and self.live.is_lost(src, now):
                raise self.live.lost(src, op, seq, now)
            if now >= deadline:
                if not self.down and not extended:
                    # nothing dropped yet: give the heartbeats time to name a frozen peer
                    # (3 missed intervals, then the grace) before blaming whoever we wait on
                    deadline, extended = now + 4 * self._grace_s, True
                    continue
                raise self.live.timeout(src, op, seq, limit)

    def _keep(self, key: tuple[int, int], msg: Message, op: str, seq: int) -> None:
        """Stash a message for a later receive, within the per-peer read-ahead bound."""
        src, h = key[0], msg.header
        ahead = self._ahead[src]
        ahead[0] += 1
        ahead[1] += h.nbytes
        max_msgs, max_bytes = self.ahead_limit
        if ahead[0] > max_msgs or ahead[1] > max_bytes:
            dropped = sum(len(q) for k, q in self._stash.items() if k[0] == src) + 1
            for k in [k for k in self._stash if k[0] == src]:
                del self._stash[k]  # the flooder's own messages only; the group is broken now
            self._ahead[src] = [0, 0]
            raise ProtocolError(
                f"rank {self.rank}, group {self.group}, during {op} (seq {seq}): peer rank {src} sent "
                f"more than this rank's operations can use ahead ({max_msgs} messages / "
                f"{max_bytes >> 20} MiB); refused its {dropped} stashed messages")
        self._stash[key].append(msg)

    def refuse(self, seq: int, coll: int, reason: str) -> None:
        """This rank refused operation ``seq`` on its own input: tell every peer (``REFUSE``), and
        drop what peers that had started it sent for it (kept, or still to come: ``stale``)."""
        self.refused_here[seq] = (coll, reason)
        self.refusals.pop(seq, None)
        self.keep_refusals_bounded()
        for (src, tag), queue in self._stash.items():
            for m in [m for m in queue if tag == -1 and m.header.seq == seq]:
                queue.remove(m)
                self._ahead[src][0] -= 1
                self._ahead[src][1] -= m.header.nbytes
        notices.tell_refused(self, seq, coll, self.rank, reason)

    def keep_refusals_bounded(self) -> None:
        """At most KEPT_REFUSALS of each kind, the oldest dropped (a peer's flood of notices
        must not grow them)."""
        for book in (self.refused_here, self.refusals):
            while len(book) > KEPT_REFUSALS:
                del book[min(book)]

    def tell_refused(self, seq: int, coll: int, origin: int, reason: str) -> None:
        """Best effort, never blocking: pass on rank ``origin``'s refusal of ``seq``, which made
        this rank give up the op it had started (``notices.tell_refused``)."""
        notices.tell_refused(self, seq, coll, origin, reason)

    def _stale(self, h: Header) -> bool:
        """A collective's piece for an op this rank refused, from a peer that had started it
        (it fails on the refusal; the piece must not be taken for one of a later op)."""
        return h.kind != P2P and h.seq in self.refused_here

    def refusal_at(self, seq: int) -> OpRefused | MismatchReport | None:
        """A peer's refusal of operation ``seq``, or its report of a mismatch there, heard
        before this rank started it."""
        return self.refusals.pop(seq, None) if self.refusals else None

    def tell_peers(self, seq: int, lost: int | None = None, report: bytes = b"",
                   connected_only: bool = False) -> None:
        """Best effort, never blocking: tell the peers this rank gives up (``notices.tell_peers``)."""
        notices.tell_peers(self, seq, lost, report, connected_only)

    def read(self, flags: int) -> Message | None:
        """One well-formed message, or None (nothing within the slice, or a malformed one)."""
        return self._read(flags)

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
            if header.src >= len(self.names) or header.src == self.rank:
                raise ProtocolError(f"a message claims to be from rank index {header.src}")
            guard = self.transport.guard
            if guard.active:
                sender = guard.peer_of(frames[0])
                if sender != self.names[header.src]:
                    raise ProtocolError(f"a message claiming to be from {self.names[header.src]} "
                                        f"came over {sender}'s key")
        except ProtocolError as exc:
            self.dropped += 1
            log.warning("rank %d dropped a malformed message (%d so far): %s", self.rank, self.dropped, exc)
            return None
        c = self._counters[header.src]
        c.recv_bytes += header.nbytes
        c.recv_msgs += 1
        return Message(header, frames[1])

    def close(self) -> None:
        """Close every socket, saying goodbye to the peers first. Only the owner calls this,
        after its last use (or once the owner has stopped): closing a socket another thread is
        blocked in aborts libzmq."""
        lingers = notices.say_goodbye(self)
        for sock in self._out.values():
            # Monitor off first: libzmq (4.3.5) drops what a socket queued before its handshake
            # finished if the socket is closed with a monitor attached, whatever the linger;
            # a group destroyed right after its first op lost that op's last message so.
            sock.disable_monitor()
        self.live.close()
        for peer, sock in self._out.items():
            sock.close(linger=lingers.get(peer, CLOSE_LINGER_MS))
        self.inbound.close(linger=0)
        self._out.clear()
        self._stash.clear()
        self._trackers.clear()
