"""The parameter server's request exchange, worker side: one request per server, sent at once,
every answer awaited.

While a call waits it pings each server every ``retry_s``: a live server answers "pending"; one
that restarted answers "unknown" and the request is sent again under a new request id, so the
pings queued during the outage (answered "unknown" too, under the old id) do not each trigger
another copy (a server that answers "unknown" to ``MAX_UNREAD`` copies in a row never reads
them: ``RequestRejected``); one silent for ``timeout_s`` becomes ``PeerLost`` naming the server, as does one
that takes no request for ``timeout_s`` (a refused handshake, or no server yet) or stops on a
failed write (it says why). A wait longer than ``WAIT_NOTICE_S`` says in the log what it waits
for (issue 31 item 3: a worker started before its servers was silent for the whole minute).

Large segments leave without a copy: ZeroMQ reads the caller's tensors from its I/O thread. A
call that ends in an error therefore abandons what is still queued to the servers that did not
answer (their sockets are replaced) and waits until ZeroMQ has let go of the caller's memory, so
the next step may overwrite it without tearing a push still on its way (issue 13.12).
"""
from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np
import zmq

from commrt.runtime.errors import CommError, PeerLost, ProtocolError, RequestRejected
from commrt.ps import protocol as P

log = logging.getLogger("commrt.ps.client")
HINT = ("is it running, under the same [security] mode and job secret or keys? a refused "
        "handshake is silent")
MAX_UNREAD = 3  # copies of one request a live server may lose in a row (each restart loses one)
WAIT_NOTICE_S = 5.0  # a wait this long is logged once, naming the server and what is awaited


def _nbytes(frame) -> int:
    return frame.nbytes if isinstance(frame, np.ndarray) else len(frame)


@dataclasses.dataclass
class _Pending:
    """One request to one server while its call waits."""
    body: list
    frames: list
    heard: float  # last reply of any kind from the server
    pinged: float
    req_id: int = 0
    head: bytes = b""
    trackers: list = dataclasses.field(default_factory=list)  # of the zero-copy frames
    noticed: bool = False  # a long wait for this server has been logged
    unread: int = 0  # 'unknown' answers to this request in a row, with no 'pending' between


class Exchange:
    """Mixed into ``PSClient`` (uses its cfg, worker, nonce, transport, _socks, _poller, _ids
    and _closing)."""

    def _dial(self, k: int) -> zmq.Socket:
        ps = self.cfg.ps
        return self.transport.dial(zmq.DEALER, ps.servers[k], f"server{k}", handshake_s=ps.timeout_s,
                                   max_frame=ps.max_segment_bytes + (4 << 20))

    def _new_poller(self) -> zmq.Poller:
        poller = zmq.Poller()
        for s in self._socks:
            poller.register(s, zmq.POLLIN)
        return poller

    # -- the exchange -----------------------------------------------------------------------
    def _exchange(self, op: int, step: int, reqs: dict[int, tuple[list, list]]) -> dict:
        """Send one request per server, wait for every answer (see the module docstring)."""
        what = f"ps.{P.OP_NAMES[op]}"
        now = time.monotonic()
        pending: dict[int, _Pending] = {}
        try:
            for k, (body, frames) in reqs.items():
                pending[k] = _Pending(body, frames, now, now)
                self._send_request(k, pending[k], op, step, what)
            done: dict = {}
            while pending:
                self._check_open(what, step)
                events = dict(self._poller.poll(int(self.cfg.ps.retry_s * 1000)))
                now = time.monotonic()
                for k in list(pending):
                    if self._socks[k] in events:
                        self._receive(k, pending, done, now, op, what, step)
                self._keep_asking(pending, now, what, step)
            return done
        except BaseException:
            self._release(pending)
            raise

    def _check_open(self, what: str, step: int) -> None:
        """close() from another thread: give the sockets back instead of having them closed
        under this call."""
        if self._closing:
            raise CommError(f"worker {self.worker}: the client was closed; {what} step {step} was cancelled")

    def _keep_asking(self, pending: dict, now: float, what: str, step: int) -> None:
        for k, entry in pending.items():
            if now - entry.heard > self.cfg.ps.timeout_s:
                raise PeerLost(k, what, step, f"{self.cfg.ps.servers[k]} silent for "
                               f"{self.cfg.ps.timeout_s:g}s ({HINT})", role="server")
            if not entry.noticed and now - entry.heard > WAIT_NOTICE_S:
                entry.noticed = True
                self._notice(k, what, step, now - entry.heard, "has not answered")
            if now - entry.pinged >= self.cfg.ps.retry_s:
                entry.pinged = now
                try:  # best effort: silence is what counts
                    self._socks[k].send(P.encode_request(P.PING, self.worker, step, entry.req_id, [], self.nonce), zmq.NOBLOCK)
                    self._count(k, sent=1)
                except zmq.Again:
                    pass

    def _send_request(self, k: int, entry: _Pending, op: int, step: int, what: str) -> None:
        """Send (or send again, under a new id) ``entry``; a server that takes no message for
        timeout_s (its handshake refused us, so there is no connection to queue on) is lost."""
        entry.req_id = next(self._ids)
        entry.head = P.encode_request(op, self.worker, step, entry.req_id, entry.body, self.nonce)
        sock, last = self._socks[k], len(entry.frames)
        start = time.monotonic()
        deadline = start + self.cfg.ps.timeout_s
        while True:
            try:
                sock.send(entry.head, zmq.SNDMORE if last else 0)
                break
            except zmq.Again:  # a slice (SNDTIMEO) went by
                self._check_open(what, step)
                if not entry.noticed and time.monotonic() - start > WAIT_NOTICE_S:
                    entry.noticed = True
                    self._notice(k, what, step, time.monotonic() - start, "has no connection to take")
                if time.monotonic() > deadline:
                    raise PeerLost(k, what, step, f"{self.cfg.ps.servers[k]} took no request within "
                                   f"{self.cfg.ps.timeout_s:g}s ({HINT})", role="server") from None
        for i, frame in enumerate(entry.frames, 1):  # the rest of a started message never blocks
            tracked = isinstance(frame, np.ndarray)
            tracker = sock.send(frame, zmq.SNDMORE if i < last else 0, copy=not tracked, track=tracked)
            if tracked:
                entry.trackers.append(tracker)
        self._count(k, sent=1, nbytes=len(entry.head) + sum(_nbytes(f) for f in entry.frames))

    def _notice(self, k: int, what: str, step: int, waited: float, state: str) -> None:
        log.warning("worker %d: waiting for server %d at %s, which %s %s step %d after %.0fs; waiting "
                    "until [ps] timeout_s = %gs (%s)", self.worker, k, self.cfg.ps.servers[k], state, what,
                    step, waited, self.cfg.ps.timeout_s, HINT)

    def _count(self, k: int, sent: int = 0, recv: int = 0, nbytes: int = 0) -> None:
        c = self.transport.counters.peer(f"server{k}")
        c.sent_msgs += sent
        c.recv_msgs += recv
        if sent:
            c.sent_bytes += nbytes
        else:
            c.recv_bytes += nbytes

    def _receive(self, k: int, pending: dict, done: dict, now: float, op: int, what: str, step: int) -> None:
        sock = self._socks[k]
        while k in pending:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._count(k, recv=1, nbytes=sum(len(f) for f in frames))
            try:
                reply = P.decode_reply(frames[0].buffer)
            except ProtocolError as exc:
                log.warning("worker %d: dropped a malformed reply from server %d: %s", self.worker, k, exc)
                continue
            entry = pending[k]
            entry.heard = now  # it answers: alive
            if reply.req_id != entry.req_id:
                continue  # a late answer to an earlier request (or ping)
            if reply.status == P.PENDING:  # it holds the request: still waiting
                entry.unread = 0
                continue
            if reply.status == P.UNKNOWN:  # the server restarted and lost it: send it again
                self._lost_again(k, entry, what, step)
                self._send_request(k, entry, op, step, what)
                continue
            del pending[k]
            try:
                P.check_reply(op, reply)
            except ProtocolError as exc:
                raise ProtocolError(f"worker {self.worker}: server {k} at {self.cfg.ps.servers[k]}, "
                                    f"{what} step {step}: {exc}") from None
            self._check_reply(k, reply, what, step)
            done[k] = (reply, frames[1:])

    def _lost_again(self, k: int, entry: _Pending, what: str, step: int) -> None:
        """A restart loses a request once; a server that keeps answering 'unknown' to every
        copy never reads them (it drops them: a frame over its size limit closes the connection,
        a header it cannot decode is discarded), and re-sending for ever would hang the call."""
        entry.unread += 1
        if entry.unread >= MAX_UNREAD:
            raise RequestRejected(k, f"{what} step {step}", f"the server at {self.cfg.ps.servers[k]} dropped "
                                  f"{entry.unread} copies unread (each answered 'unknown'): a frame over its "
                                  "limit ([ps] max_segment_bytes smaller there than here?) or a header it "
                                  "cannot decode (see its log)")
        log.warning("worker %d: server %d lost %s step %d; sending it again", self.worker, k, what, step)

    @staticmethod
    def _check_reply(k: int, reply: P.Reply, what: str, step: int) -> None:
        if reply.status == P.ERROR:
            raise RequestRejected(k, f"{what} step {step}", str(reply.body[0]))
        if reply.status == P.FAILED:
            raise PeerLost(k, what, step, str(reply.body[0]), role="server")
        if reply.status == P.LOST:
            missing = reply.body[1] or [-1]
            raise PeerLost(missing[0], what, step, str(reply.body[0]), role="worker")

    def _release(self, pending: dict[int, _Pending]) -> None:
        """After an error: what is still queued to a server that did not answer must not reach
        it later with the caller's memory changed, so that socket (and its queue) is replaced;
        then wait until ZeroMQ has let go of every zero-copy frame."""
        for k, entry in pending.items():
            if all(t.done for t in entry.trackers):
                continue
            self._socks[k].close(linger=0)
            self._socks[k] = self._dial(k)
            self._poller = self._new_poller()
            for t in entry.trackers:
                try:
                    t.wait(self.cfg.ps.timeout_s)
                except zmq.NotDone:
                    log.error("worker %d: ZeroMQ still holds a frame for server %d after %gs",
                              self.worker, k, self.cfg.ps.timeout_s)
