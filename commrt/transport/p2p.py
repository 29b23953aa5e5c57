"""Point-to-point progress engine: one thread owns a group's point-to-point Endpoint.

Callers post transfers (``post``) and get a ``Work``; the engine thread sends posted pieces the
sockets did not take at once (p2p_send.py), matches arriving messages to posted receives
(matching.py: by (source, tag) in posting order, or from any source by tag) and keeps what
arrives early (bounded per peer). A receive's Work result is the sender's rank. Nothing
blocks on one transfer, so irecv-then-isend on both sides cannot deadlock, and transfers
overlap the caller's compute. The MPI progress-engine design, and NCCL's proxy thread, in
small: one owner per socket (transport.py's ownership rules), woken through an inproc pair.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Callable

import zmq

from commrt.runtime.errors import CollectiveMismatch, GroupClosed, PeerLost, ProtocolError
from commrt.transport.wire import P2P, P2P_DOORBELL
from commrt.transport import shm, shm_p2p
from commrt.transport.endpoint import Endpoint, Message
from commrt.transport.matching import ANY_SOURCE, Matching, Recv
from commrt.transport.p2p_send import Send, Sender
from commrt.transport.progress import ENGINE, CallerProgress, Reader

__all__ = ["ANY_SOURCE", "P2PEngine", "Recv", "Send"]

log = logging.getLogger(__name__)

UNEXPECTED_BYTES = 1 << 30  # early point-to-point data kept per peer before it counts as a flood
UNEXPECTED_MSGS = 1 << 20  # and early messages (a few hundred bytes of objects each, even empty)
BUSY_POLL_MS = 1  # while sends wait on a full pipe or ZeroMQ still reads our buffers
# How long a waiting receive watches its mailboxes before it blocks on the socket, with a core per
# rank. A pipeline stage waits milliseconds for its peer's compute: a receiver still watching
# takes the message from its mailbox (1 MiB one way ~80 us) instead of through ZeroMQ's I/O
# threads (~280 us, three thread wake-ups; issue 29). It yields its core all the while.
SPIN_S = 0.002


class P2PEngine(CallerProgress):
    """The engine thread's half; the caller's half (drive/test/kick) is progress.CallerProgress,
    the send path p2p_send.Sender."""

    def __init__(self, ep: Endpoint, timeout_s: float, members: list[int] | None = None):
        """``members``: the global rank of each group rank (None: the group numbers ranks as
        the world does); a failed transfer's PeerLost or CollectiveMismatch names those."""
        self._ep, self._timeout_s, self._members = ep, timeout_s, members
        # sends (PUSH sockets, out rings, _out's queues), _posted, the wake socket's sending
        # end and the endpoint's monitors. No Work finishes under it (_finish_sends): its
        # callbacks may post, and a poster holds the PointToPoint lock while it waits for this
        self._tx = threading.RLock()
        self._posted: collections.deque = collections.deque()  # receives posted while the socket was busy
        self._wake_tx, self._wake_rx = ep.transport.inproc_pair(f"p2p{ep.group}")
        self._reader = Reader(self._wake)  # the inbound socket, Matching and the in rings
        self._closing = False
        self._thread: threading.Thread | None = None
        self._out = Sender(ep, timeout_s)
        self._match = Matching(ep.rank, self._bind, _release, time.monotonic)
        self._rings: shm_p2p.Rings | None = None
        self._inboxes: dict = {}  # peer -> mailbox.Inbox, with the rings
        self._spin_s = 0.0  # how long a waiting receive watches the mailboxes before it blocks
        self._checked_at = 0.0  # the reader's last look at receive deadlines and peers
        self._dialled: set[int] = set()  # peers a receive has dialled (_bind)

    def use_shm(self, peers: dict) -> None:
        """Large payloads to and from ``peers`` (peer -> its (OutRing, InRing), handed over at connect)
        through shared-memory rings; called once, before the first transfer."""
        self._rings = self._out.rings = shm_p2p.Rings(peers)
        self._inboxes = self._rings.inboxes
        crowded = len(peers) + 1 > shm._cores()  # ranks outnumber cores: a spinner takes a peer's turn
        self._spin_s = shm.CROWDED_YIELD_S if crowded else SPIN_S

    def named(self, error: BaseException) -> BaseException:
        """``error`` naming global ranks, as a subgroup's collectives do (ZmqBackend._give_up)."""
        if self._members is not None and isinstance(error, (PeerLost, CollectiveMismatch)):
            return error.in_group(self._members, self._ep.group)
        return error

    def _global(self, rank: int) -> int:
        """The global rank of group rank ``rank``, for errors named() does not translate."""
        return rank if self._members is None else self._members[rank]

    def post(self, op: Send | Recv) -> Any:
        """A send goes out from the caller's thread when nothing to its destination is queued
        ahead of it (the engine takes over what the socket or ring does not take at once); a
        receive is matched against what has arrived, then waits for ``wait()`` or the engine."""
        op.since = time.monotonic()
        if type(op) is Send:
            with self._tx:
                if self._closing or self._thread is None:  # checks inline: on every message's path
                    self._check_open(op)
                    self._start()
                wake = self._out.post(op)
                settled = self._out.settled()  # only op: the engine takes its own under _tx
            if settled:
                self._finish_sends(settled)
            if wake:
                self._wake()
            return op.work
        if self._thread is None:
            with self._tx:
                self._start()  # it watches the deadlines of receives nobody waits on
        if self._reader.try_take(threading.get_ident()):
            try:
                if self._closing:
                    self._check_open(op)
                if not self._posted:
                    self._match_recv(op)
                    return op.work
            finally:
                self._reader.release()
        # Someone reads the socket, or receives posted meanwhile wait: the reader matches them
        # in posting order. Not this thread: it holds the PointToPoint lock, and matching one
        # runs its done-callbacks, which may post (a second take of that lock hangs for ever).
        with self._tx:
            self._check_open(op)
            self._posted.append(op)
            self._start()
        self._wake()
        return op.work

    def _check_open(self, op) -> None:
        if self._closing:
            raise GroupClosed(self._ep.group, "send" if isinstance(op, Send) else "recv", op.seq)

    def _start(self) -> None:
        if self._thread is None:  # under _tx
            self._thread = threading.Thread(target=self._run, name=f"commrt-group{self._ep.group}-p2p",
                                            daemon=True)
            self._thread.start()

    def _wake(self) -> None:
        with self._tx:
            try:
                self._wake_tx.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:  # closed, or a wake-up is pending anyway
                pass

    def _bind(self, src: int) -> None:
        """A receive waits on ``src``: dial it, so its connection's monitor is our liveness."""
        if src not in self._dialled:  # once: the lock and lookup cost ~1 us a receive (issue 29)
            with self._tx:
                self._ep.socket_to(src)
            self._dialled.add(src)

    # -- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        reading, idle = zmq.Poller(), zmq.Poller()
        for poller in (reading, idle):
            poller.register(self._wake_rx, zmq.POLLIN)
        reading.register(self._ep.inbound, zmq.POLLIN)
        try:
            while not self._closing:
                mine = self._hold_reader()
                busy = self._out.busy()
                events = dict((reading if mine else idle).poll(BUSY_POLL_MS if busy else self._ep.live.slice_s * 1000))
                if self._wake_rx in events:
                    self._drain_wake()
                now = time.monotonic()
                if mine:
                    self._take_posted()
                    self.drain_mail()  # what a receiver that stopped spinning left (mailbox.py)
                    if self._ep.inbound in events:
                        self._read_all()
                    self._check_if_due(now)
                elif not self._reader.wanted and self._reader.try_take(ENGINE):
                    try:  # nobody reads: the peers' liveness is still watched (sends to a lost one fail)
                        self._check_if_due(now)
                    finally:
                        self._reader.release()
                with self._tx:
                    self._out.progress(now)
                    settled = self._out.settled()
                self._finish_sends(settled)
        except BaseException as exc:  # a bug here must not leave callers waiting for ever
            log.exception("group %d: point-to-point engine failed", self._ep.group)
            self._stop(exc)
            return
        self._stop(None)

    def _hold_reader(self) -> bool:
        """Read the socket while receives wait that no caller reads for; give it up when one asks."""
        mine = self._reader.holder == ENGINE
        need = self._receives_waiting() and not self._reader.wanted
        if mine and not need:
            self._reader.release()
            return False
        if need and not mine:
            return self._reader.try_take(ENGINE)
        return mine

    def _stop(self, failure: BaseException | None) -> None:
        self._closing = True  # callers reading the socket let go of it within a slice
        closed = lambda op: failure or GroupClosed(self._ep.group, "send" if isinstance(op, Send) else "recv", op.seq)
        mine = self._reader.holder == ENGINE or self._reader.take(ENGINE, lambda: False, time.monotonic() + 5.0)
        self._fail_all(closed)
        if not mine:  # a caller still reads the socket (it leaves within a slice of _closing)
            log.warning("group %d: a receive did not stop reading; leaving the sockets open", self._ep.group)
            return
        with self._tx:
            self._ep.close()  # the owner closes its sockets, after their last use
            self._wake_rx.close(linger=0)
            if self._rings is not None:
                self._rings.close()

    def _drain_wake(self) -> None:
        while True:
            try:
                self._wake_rx.recv(zmq.NOBLOCK)
            except zmq.Again:
                return

    def _take_posted(self) -> None:
        """Match the receives posted while the socket was busy (the reader calls this)."""
        if not self._posted:
            return
        with self._tx:
            posted, self._posted = self._posted, collections.deque()
        for op in posted:
            self._match_recv(op)
        self._reader.landed()  # one may have met a kept message: its poster may wait for the socket

    def _match_recv(self, op: Recv) -> None:
        for peer in (self._ep.all_peers("a receive from any source") if op.src == ANY_SOURCE else ()):
            if peer != self._ep.rank:  # dialled, so its monitor reports a dead sender (issue 30.11)
                self._bind(peer)
        self._match.post(op)

    def _check_if_due(self, now: float) -> None:
        """Once a slice: the liveness monitors (their owner is the reader: Matching reads what
        they found), the mailboxes (a doorbell a full pipe did not take: mailbox.py rule 3) and
        the receives' deadlines."""
        if now - self._checked_at >= self._ep.live.slice_s:
            self._checked_at = now
            with self._tx:
                self._ep.live.watch()
            if self._inboxes:
                self.drain_mail()
            self._check_recvs(now)

    def _read_all(self) -> None:
        while True:
            msg = self._ep.read(zmq.NOBLOCK)
            if msg is None:
                return
            self._on_message(msg)

    def _on_message(self, msg: Message) -> None:
        """A message from the socket."""
        h = msg.header
        if h.kind != P2P:
            return  # collectives' ABORTs travel on the collective endpoint
        inbox = self._inboxes.get(h.src)
        if inbox is not None:  # what the sender put in its mailbox before this comes first
            self._drain(inbox)
            inbox.socket_read()
        if h.root == P2P_DOORBELL:
            return
        if h.root == shm_p2p.SHM_ROOT:
            msg = self._from_ring(msg)
            if msg is None:
                return
        self._deliver(msg)

    def _deliver(self, msg: Message) -> None:
        h = msg.header
        if self._match.arrive(msg):
            self._reader.landed()
            return
        if self._match.keep(msg) <= UNEXPECTED_BYTES and self._match.early_msgs[h.src] <= UNEXPECTED_MSGS:
            return
        self._fail_all(lambda op: ProtocolError(
            f"rank {self._global(self._ep.rank)}: peer rank {self._global(h.src)} of group {self._ep.group} sent "
            f"more than {UNEXPECTED_BYTES >> 20} MiB or more than {UNEXPECTED_MSGS} messages of point-to-point "
            "data no receive was posted for"), peer=h.src)
        self._match.drop_early(h.src)

    def _from_ring(self, msg: Message) -> Message | None:
        """A descriptor -> the message as if its payload had come over the socket."""
        h = msg.header
        try:
            if self._rings is None:
                raise ProtocolError(f"rank index {h.src} sent a shared-memory descriptor to a TCP-only group")
            region = self._rings.region(h.src, msg.payload)
        except (ProtocolError, OSError) as exc:
            error = exc if isinstance(exc, ProtocolError) else ProtocolError(f"cannot map rank index {h.src}'s ring: {exc}")
            log.warning("rank %d: %s", self._ep.rank, error)
            self._fail_all(lambda op: error, peer=h.src)
            return None
        return Message(h._replace(nbytes=len(region), root=0), region)

    def _check_recvs(self, now: float) -> None:
        overdue = self._match.overdue(now, self._timeout_s, self._ep.live)
        for op, error in overdue:
            op.work._finish(None, error)
        if overdue:
            self._reader.landed()  # a waiter queued for the socket sees its receive is done

    def _finish_sends(self, settled: list) -> None:
        """Finish the Works of sends the Sender decided, outside ``_tx``: their callbacks may post.
        A callback's own failure is logged (as a receive's is, matching.py), not left to stop
        the engine with the rest of ``settled`` unfinished."""
        for op, error in settled:
            try:
                op.work._finish(None, error)
            except Exception:
                log.exception("rank %d: a done-callback of a send to rank %d failed", self._ep.rank, op.dst)

    def _fail(self, op, error: BaseException) -> None:
        if not op.work._done.is_set():
            op.work._finish(None, error)

    def _fail_all(self, error: Callable, peer: int | None = None) -> None:
        """Fail every transfer (to or from ``peer``); the caller holds the reader."""
        with self._tx:
            queued, draining = self._out.take(peer)
            posted = [] if peer is not None else list(self._posted)
            if peer is None:
                self._posted = collections.deque()
        for op in queued:
            self._fail(op, error(op))
        anywhere = list(self._match.any.values()) if peer is None else []  # from any source: only when all fail
        for queue in list(self._match.recvs.values()) + anywhere:
            for op in [op for op in queue if peer is None or op.src == peer]:
                self._fail(op, error(op))
                queue.remove(op)
        for op in draining + posted:
            self._fail(op, error(op))
        self._reader.landed()  # waiters queued for the socket (that the engine may never give back)

    # -- lifetime --------------------------------------------------------------------------
    def close(self, timeout_s: float) -> bool:
        """Stop the engine: posted transfers fail with GroupClosed; the thread closes its
        sockets itself. Returns whether it stopped within ``timeout_s``."""
        with self._tx:
            self._closing = True
            thread = self._thread
            try:
                self._wake_tx.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        if thread is None:  # never started: this thread owns the sockets, and the rings
            self._ep.close()
            self._wake_rx.close(linger=0)
            if self._rings is not None:
                self._rings.close()
            stopped = True
        else:
            thread.join(timeout_s)
            stopped = not thread.is_alive()
        with self._tx:
            if stopped:
                self._wake_tx.close(linger=0)
        return stopped


def _release(msg: Message) -> None:
    """Hand a ring payload's space back to its sender (a socket frame needs nothing)."""
    if isinstance(msg.payload, shm_p2p.Region):
        msg.payload.release()
