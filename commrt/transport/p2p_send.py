"""The send side of the point-to-point engine (p2p.py): per-destination queues in posting order,
pieces pushed as the socket or the shared-memory ring takes them, and sends whose zero-copy
buffers ZeroMQ still reads ("draining"). The engine calls every method here under its lock
(``P2PEngine._tx``): the PUSH sockets and the out rings have one owner at a time. Nothing here
finishes a Work: a send's outcome is decided here and handed over (``Sender.settled``) for the
engine to finish after it lets go of that lock, since a Work's done-callbacks may post.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

import zmq

from commrt.runtime.errors import PeerLost
from commrt.transport import shm_p2p
from commrt.transport.endpoint import ZERO_COPY_MIN_BYTES, Endpoint
from commrt.runtime import dtypes
from commrt.transport.wire import P2P, P2P_DOORBELL, Header, encode_header

UINT8 = dtypes.CODES["uint8"]  # a doorbell's dtype (it carries no bytes)
_MORE_NOBLOCK = int(zmq.SNDMORE | zmq.NOBLOCK)  # an int: or-ing zmq's enums costs ~2 us a message


@dataclass
class Send:
    dst: int
    tag: int
    seq: int
    frames: list  # [(header, payload)] pieces in order
    work: Any  # the caller's Work handle (work.py, a layer above), finished by the engine (settled)
    sent: int = 0
    trackers: list = field(default_factory=list)
    since: float = 0.0  # last progress
    over: bool = False  # its outcome is decided (Sender._settle): nothing here touches it again


class Sender:
    def __init__(self, ep: Endpoint, timeout_s: float):
        self._ep, self._timeout_s = ep, timeout_s
        self.rings: shm_p2p.Rings | None = None  # set by P2PEngine.use_shm before the first transfer
        self._queues: dict[int, collections.deque] = collections.defaultdict(collections.deque)
        self._draining: list[Send] = []
        self._settled: list[tuple[Send, BaseException | None]] = []

    def post(self, op: Send) -> bool:
        """Send what goes out now; whether the engine must wake for the rest (else ``op`` is
        settled). To a peer whose connection is lost (liveness.py) nothing goes: ZeroMQ would
        take it and drop it, or hold it, and the send fail only at its deadline (a receive
        fails at once)."""
        live = self._ep.live
        if live.down and live.is_lost(op.dst, op.since):
            self._settle(op, live.lost(op.dst, "send", op.seq, op.since))
            return False
        queue = self._queues[op.dst]
        if queue or not self._push(op, op.since):
            queue.append(op)  # behind the queued ones (send order), or the rest of its pieces
            return True
        if op.trackers and not op.over:  # ZeroMQ still reads our buffers: the engine watches them
            self._draining.append(op)
            return True
        self._settle(op, None)
        return False

    def settled(self) -> list[tuple[Send, BaseException | None]]:
        """The sends decided since the last call, as (send, error or None), for the engine to
        finish once it has let go of its lock: a done-callback may isend, which takes the
        group's PointToPoint lock, and a thread inside isend holds that lock while it waits for
        the engine's (review_pp item 1: the two deadlocked for ever)."""
        settled = self._settled
        if settled:
            self._settled = []
        return settled

    def _settle(self, op: Send, error: BaseException | None) -> None:
        if not op.over:
            op.over = True
            self._settled.append((op, error))

    def busy(self) -> bool:
        """Pieces wait for the pipe, or buffers for ZeroMQ: the engine polls briefly."""
        return bool(self._draining) or any(list(self._queues.values()))

    def progress(self, now: float) -> None:
        live = self._ep.live
        for dst in [d for d in live.down if live.is_lost(d, now)]:  # what waits for it never goes
            queued, draining = self.take(dst)
            self._settled += [(op, live.lost(dst, "send", op.seq, now)) for op in queued + draining]
        for queue in self._queues.values():
            while queue and self._push(queue[0], now):
                op = queue.popleft()
                self._draining.append(op)
                if queue and not op.over:  # the pipe moved: the next one waits from now
                    queue[0].since = max(queue[0].since, now)
        self._draining = [op for op in self._draining if not self._drained(op, now)]

    def take(self, peer: int | None) -> tuple[list[Send], list[Send]]:
        """Remove the queued and the draining sends to ``peer`` (every one when None) not yet
        decided, for the caller to fail: they are its to finish, and decided here (``over``)."""
        mine = lambda op: not op.over and (peer is None or op.dst == peer)
        queued = []
        for queue in self._queues.values():
            for op in [op for op in queue if mine(op)]:
                queue.remove(op)
                queued.append(op)
        draining = [op for op in self._draining if mine(op)]
        for op in queued + draining:
            op.over = True
        self._draining = [op for op in self._draining if not op.over]
        return queued, draining

    def _push(self, op: Send, now: float) -> bool:
        """Send what the pipe takes; True once every piece is queued."""
        sock, rings = self._ep.socket_to(op.dst), self.rings
        while op.sent < len(op.frames):
            header, payload = op.frames[op.sent]
            # a small payload (most messages) never takes the ring: no call to find that out
            place = rings.place(op.dst, payload) if rings is not None and len(payload) >= shm_p2p.MIN_BYTES else None
            if place is shm_p2p.FULL:
                if now - op.since < shm_p2p.FULL_WAIT_S:
                    return False  # retried within BUSY_POLL_MS: the receiver is usually copying out
                place = None  # it is not taking it: inline, as the socket would have it
            body = payload
            if place is not None:  # the payload goes into our ring to dst; a descriptor says where
                body = shm_p2p.descriptor(*place)
                header = header._replace(nbytes=len(body), root=shm_p2p.SHM_ROOT)
            if rings is not None and rings.mail_open(op.dst):  # a waiting receiver: its mailbox
                if place is not None:
                    rings.write(op.dst, place[0], payload)  # before the descriptor is published
                put = rings.put(op.dst, header, body)
                if put is not None:
                    if put is False:
                        self._doorbell(sock, op.dst)
                    self._ep.count_sent(op.dst, P2P, 0, len(payload))
                    op.sent += 1
                    op.since = now
                    continue
                place = None if place is None else (place[0], -1, "")  # written already
            try:
                sock.send(encode_header(header), _MORE_NOBLOCK)
            except zmq.Again:
                if now - op.since > self._timeout_s:
                    self._settle(op, PeerLost(op.dst, "send", op.seq, f"could not send within {self._timeout_s:g}s"))
                    return True
                return False
            if place is not None:
                if place[1] >= 0:
                    self.rings.write(op.dst, place[0], payload)
                sock.send(body, copy=True)
            elif len(payload) >= ZERO_COPY_MIN_BYTES:
                op.trackers.append(sock.send(payload, copy=False, track=True))
            else:
                sock.send(payload, copy=True)
            if self.rings is not None:
                self.rings.sent_on_socket(op.dst)
            # op code 0: comm_stats()["by_op"]["p2p"], inside / across nodes
            self._ep.count_sent(op.dst, P2P, 0, len(payload))
            op.sent += 1
            op.since = now
        return True

    def _doorbell(self, sock, dst: int) -> None:
        """Tell ``dst`` to look in its mailbox (it stopped spinning as we wrote; mailbox.py rule 3).
        Should the pipe be full, its reader's next slice looks anyway."""
        bell = Header(P2P, self._ep.group, 0, self._ep.rank, 0, UINT8, 0, 0, 0, 0, P2P_DOORBELL)
        try:
            sock.send_multipart([encode_header(bell), b""], zmq.NOBLOCK)
        except zmq.Again:
            return
        self.rings.sent_on_socket(dst)

    def _drained(self, op: Send, now: float) -> bool:
        if op.over:
            return True
        if all(t.done for t in op.trackers):
            self._settle(op, None)
            return True
        if now - op.since > self._timeout_s:
            self._settle(op, PeerLost(op.dst, "send", op.seq, "send not drained before the deadline"))
            return True
        return False
