"""Who progresses a group's point-to-point receives: the engine thread, or the caller that waits.

Handing every receive to the engine thread and back cost two thread wake-ups per message, plus
the GIL changing hands each time: of a 4 KiB transfer's 200 us one way on a 2-core machine, 13
us went to waking the engine on a post, 17-18 us to waking the caller when the engine finished
its Work, and most of the engine's 24-29 us per message to running beside the caller (see
``commrt bench p2p``). So a caller that waits for a receive reads the inbound socket itself
(MPI's model: the waiting thread makes progress), and the engine keeps what nobody waits on
(irecv's overlap, callbacks, deadlines of receives nobody watches).

One reader at a time (``Reader``): ZeroMQ sockets and ``Matching`` have one owner. The engine
gives the socket up when a caller asks; a caller that cannot have it sleeps until it is free or
its own receive is done (the reader lands every message, not only its own, and wakes it), so
two threads receiving on one group never wait on each other's message.

Where the rest of a small message's time goes (2-core machine, 4 KiB, ~75 us one way): raw
pyzmq PUSH/PULL between two processes takes 26 us; the Python on both sides about 25 us of CPU;
and the sending thread is off the CPU for ~85 us inside the send of a message's last part (3 us
of it on the CPU), while ZeroMQ's I/O threads and the peer run on the two cores. Below that
floor, small node-local messages would have to bypass ZeroMQ's I/O threads.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable

import zmq

from commrt.runtime.work import Work
from commrt.runtime.errors import ProtocolError
from commrt.transport import shm_p2p
from commrt.transport.mailbox import barrier

ENGINE = "engine"
SOCKET_EVERY = 8  # a spinning receiver's turns between looks at its socket (CallerProgress._spin)
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)

log = logging.getLogger("commrt.transport.p2p")


class Reader:
    """Ownership of the inbound side: nobody (``None``), the engine thread, or a caller's thread."""

    def __init__(self, wake_engine: Callable[[], None]):
        self._lock = threading.Lock()  # taken directly where nobody waits (a C call, not Condition's)
        self._cv = threading.Condition(self._lock)
        self.holder: object = None
        self.wanted = 0  # callers waiting for the socket: the engine gives it up
        self._wake_engine = wake_engine

    def try_take(self, who: object) -> bool:
        with self._lock:
            if self.holder is not None:
                return False
            self.holder = who
            return True

    def take(self, who: object, done: Callable[[], bool], deadline: float | None) -> bool:
        """Wait until the socket is ours (True), or ``done()`` or the deadline came first."""
        with self._cv:
            self.wanted += 1
            try:
                while self.holder is not None:
                    if done():
                        return False
                    if self.holder == ENGINE:
                        self._wake_engine()  # it gives the socket up on its next turn
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    self._cv.wait(left)
                self.holder = who
                return True
            finally:
                self.wanted -= 1

    def release(self) -> None:
        with self._lock:
            self.holder = None
            if self.wanted:
                self._cv.notify_all()

    def landed(self) -> None:
        """A reader finished somebody's receive: whoever waits for the socket re-checks its own."""
        if self.wanted:
            with self._cv:
                self._cv.notify_all()


class P2PWork(Work):
    """A point-to-point Work. ``wait()`` on a receive reads the socket in the caller's thread when
    the socket is free; ``is_completed()`` first lands what has arrived (never blocking);
    ``add_done_callback`` hands the receive to the engine, which then completes it unwatched."""

    def __init__(self, name: str, engine, receive: bool):
        super().__init__(name)
        self._engine, self._receive = engine, receive

    def _finish(self, result, error) -> None:
        if error is not None:  # the transport names group ranks; the caller reads global ones
            error = self._engine.named(error)
        super()._finish(result, error)

    def wait(self, timeout: float | None = None) -> bool:
        if self._receive and not self._done.is_set():
            deadline = None if timeout is None else time.monotonic() + timeout
            self._engine.drive(self, deadline)
            if deadline is not None and not self._done.wait(max(0.0, deadline - time.monotonic())):
                raise self._timeout(timeout)  # the caller's timeout, not the nothing left of it
        return super().wait(timeout)

    def is_completed(self) -> bool:
        if self._receive and not self._done.is_set():
            self._engine.test()
        return self._done.is_set()

    def add_done_callback(self, fn: Callable[[Work], None]) -> None:
        super().add_done_callback(fn)
        if self._receive and not self._done.is_set():
            self._engine.kick()


class CallerProgress:
    """The caller's half of the point-to-point engine (p2p.P2PEngine, which mixes this in):
    what ``P2PWork`` asks of it, run in the thread that waits or tests."""

    def drive(self, work: P2PWork, deadline: float | None) -> None:
        """Read the socket in this thread until ``work`` is done, the deadline passes or the
        group closes; while another thread reads, wait for it to land ``work`` or let go."""
        me = threading.get_ident()
        if not self._reader.try_take(me) and not self._reader.take(me, work._done.is_set, deadline):
            return
        try:
            if self._posted:
                self._take_posted()
            if self._inboxes and self._spin_s and not work._done.is_set():
                self._spin(work, deadline)
            slice_ms = int(self._ep.live.slice_s * 1000)
            while not work._done.is_set() and not self._closing:
                left_ms = slice_ms if deadline is None else int((deadline - time.monotonic()) * 1000)
                if left_ms >= slice_ms:  # one blocking read: no poll round trip on the latency path
                    msg = self._ep.read(0)
                else:
                    msg = self._ep.read(zmq.NOBLOCK) if self._ep.inbound.poll(max(0, left_ms)) else None
                if msg is not None:
                    self._on_message(msg)
                now = time.monotonic()
                self._check_if_due(now)
                if deadline is not None and now >= deadline:
                    return
                if self._posted:
                    self._take_posted()
        finally:
            self._reader.release()
            if self._receives_waiting() and self._unwatched():
                self._wake()  # the engine lands the rest (irecvs nobody waits on yet)

    def _spin(self, work: P2PWork, deadline: float | None) -> None:
        """Watch the mailboxes (and the socket) for up to ``_spin_s`` (p2p.SPIN_S), telling the
        senders so, before ``drive`` blocks on the socket (mailbox.py's rules 1 and 3)."""
        inboxes = list(self._inboxes.values())
        for inbox in inboxes:
            inbox.spin(True)
        try:
            end = time.monotonic() + self._spin_s
            if deadline is not None:
                end = min(end, deadline)
            is_done, inbound, turn = work._done.is_set, self._ep.inbound, 0
            while not is_done() and not self._closing:
                got = self.drain_mail()
                # the socket every SOCKET_EVERY turns: a spinning receiver's senders use its
                # mailbox (what the socket brings left before the spin began, through ZeroMQ's
                # I/O threads: tens of us). EVENTS first: a read that finds nothing raises
                # zmq.Again, ~10x the cost; ints, not zmq's enums (~3 us a look, issue 29)
                if not turn % SOCKET_EVERY and inbound.get(_EVENTS) & _POLLIN:
                    msg = self._ep.read(zmq.NOBLOCK)
                    if msg is not None:
                        self._on_message(msg)
                        got = True
                turn += 1
                if self._posted:
                    self._take_posted()
                if is_done() or time.monotonic() >= end:
                    return
                if not got:
                    os.sched_yield()  # a peer on this core gets its turn
        finally:
            for inbox in inboxes:
                inbox.spin(False)
            barrier()
            self.drain_mail()  # what landed while we stopped

    def drain_mail(self) -> bool:
        """Land what the mailboxes hold (the reader calls this); whether there was anything."""
        got = False
        for inbox in list(self._inboxes.values()):  # _drain may drop one
            if inbox.pending():
                self._drain(inbox)
                got = True
        return got

    def _drain(self, inbox) -> None:
        try:
            msgs = inbox.take()
        except ProtocolError as exc:
            error = exc  # the except clause's name goes when it ends
            log.warning("rank %d: %s; its mailbox is not read again", self._ep.rank, error)
            # read no more (it would fail the peer again on every turn): with nobody spinning on
            # it, its sender takes the socket (mailbox.py rule 1)
            self._inboxes.pop(inbox.src, None)
            inbox.spin(False)
            self._fail_all(lambda op: error, peer=inbox.src)
            return
        for msg in msgs:
            if msg.header.root == shm_p2p.SHM_ROOT:  # a descriptor: the payload lies in its ring
                msg = self._from_ring(msg)
                if msg is None:
                    continue
            self._deliver(msg)

    def test(self) -> None:
        """Land what has arrived, without blocking (``is_completed`` of a receive)."""
        if self._closing or not self._reader.try_take(threading.get_ident()):
            return
        try:
            self._take_posted()
            self.drain_mail()
            self._read_all()
        finally:
            self._reader.release()

    def kick(self) -> None:
        """A receive wants completing unwatched (a done-callback): the engine reads for it."""
        self._wake()

    def _unwatched(self) -> bool:
        """A waiting receive has a done-callback: nobody's wait will land it, so the engine must
        read for it now. Receives a caller will wait for are left to that wait: a pipeline posts
        a step's receives at its start, and an engine woken to read for them held the socket
        when the stage came to wait, which then had to ask for it back (a thread hop, ~0.25 ms
        a receive on a loaded 2-core machine; issue 29). The engine still reads for them at its
        next turn (a slice at most). list() as in ``_receives_waiting``: the engine may hold
        the reader and change the queues meanwhile; ``_callbacks`` is None once a Work is done."""
        queues = [list(self._posted), *map(list, list(self._match.recvs.values())),
                  *map(list, list(self._match.any.values()))]
        return any(op.work._callbacks for queue in queues for op in queue)

    def _receives_waiting(self) -> bool:
        # list(): one C call, so another thread adding a key cannot break the iteration
        return bool(self._posted) or any(list(self._match.recvs.values())) or any(list(self._match.any.values()))
