"""A request/reply channel over the ``Transport``: the rendezvous store uses it, the parameter
server can (ps-lite's ``Customer``, which tracks requests by timestamp, is the model).

Each message is one msgpack envelope ``[VERSION, kind, req_id, method, body]`` plus, optionally,
raw frames after it. ``encode``/``decode`` are pure and strict: no extension types, every field
checked, and array/string lengths bounded by the frame's own size (msgpack derives its limits
from ``len(frame)``), so a request is bounded by bytes, not by an arbitrary entry count.

- ``RpcClient`` (DEALER): every call has a deadline and a fresh request id; a reply carrying
  another id (a late answer to an earlier call that timed out) is discarded and counted, never
  returned as the answer to this one. One call at a time per client (a lock). With
  ``lost_after_s`` a monitor watches its connection: once the connection was up and then stays
  down longer than that (the server's process ended, or it stopped answering heartbeats), a call
  raises ``RpcLost`` within a slice instead of waiting out its deadline.
- ``RpcServer`` (ROUTER): one serving thread owns the socket. The handler runs on that thread;
  whatever it raises becomes an error reply and a counted, logged rejection, never the thread's
  death. A handler may return ``DEFER`` and answer later with ``Call.reply`` (from any thread:
  replies from elsewhere are queued and the serving thread is woken to send them).
"""
from __future__ import annotations

import collections
import itertools
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import msgpack
import zmq
from zmq.utils.monitor import recv_monitor_message

from commrt.obs.ratelimit import RateLimited
from commrt.runtime.errors import CommError, ProtocolError

log = logging.getLogger(__name__)
_limited = RateLimited(log)  # what a misbehaving client makes us say, once per request

VERSION = 1
REQUEST, REPLY, ERROR = 0, 1, 2
MAX_REQ_ID = (1 << 63) - 1
MAX_METHOD = 64
SLICE_S = 0.1  # longest a socket wait lasts before deadlines and the stop flag are re-checked
DEFER = object()  # a handler's "I will answer later with Call.reply"


class RpcTimeout(CommError):
    """No answer in time. ``phase``: 'send' (the request could not even be queued: no
    connection, e.g. a refused handshake) or 'reply'."""

    def __init__(self, peer: str, method: str, req_id: int, waited_s: float, phase: str):
        self.peer, self.method, self.req_id, self.waited_s, self.phase = peer, method, req_id, waited_s, phase
        what = "took no request" if phase == "send" else "did not answer"
        super().__init__(f"{peer} {what} within {waited_s:g}s ({method}, request {req_id})")


class RpcLost(CommError):
    """The connection to the server was up, then down longer than the client's grace."""

    def __init__(self, peer: str, method: str, req_id: int, down_s: float):
        self.peer, self.method, self.req_id, self.down_s = peer, method, req_id, down_s
        super().__init__(f"{peer} lost its connection {down_s:.1f}s ago ({method}, request {req_id})")


class RpcRejected(CommError):
    """The server answered with an error (a bad request, or its handler failed)."""

    def __init__(self, peer: str, method: str, reason: str):
        self.peer, self.method, self.reason = peer, method, reason
        super().__init__(f"{peer} rejected {method}: {reason}")


@dataclass(frozen=True)
class Envelope:
    kind: int
    req_id: int
    method: str
    body: Any


def encode(env: Envelope) -> bytes:
    return msgpack.packb([VERSION, env.kind, env.req_id, env.method, env.body], use_bin_type=True)


def decode(buf: bytes, max_bytes: int) -> Envelope:
    """The envelope in ``buf``, or ``ProtocolError`` saying what is wrong with it."""
    if len(buf) > max_bytes:
        raise ProtocolError(f"rpc envelope of {len(buf)} bytes exceeds the limit of {max_bytes}")
    try:
        msg = msgpack.unpackb(buf, raw=False, max_ext_len=0, strict_map_key=True)
    except Exception as exc:  # msgpack raises several types for garbage; all mean the same here
        raise ProtocolError(f"undecodable rpc envelope: {type(exc).__name__}: {exc}") from None
    if not isinstance(msg, list) or len(msg) != 5:
        raise ProtocolError("rpc envelope must be [version, kind, req_id, method, body]")
    version, kind, req_id, method, body = msg
    if version != VERSION:
        raise ProtocolError(f"rpc version {version!r}, expected {VERSION}")
    if kind not in (REQUEST, REPLY, ERROR) or isinstance(kind, bool):
        raise ProtocolError(f"rpc kind {kind!r} is not one of {REQUEST, REPLY, ERROR}")
    if type(req_id) is not int or not 0 <= req_id <= MAX_REQ_ID:
        raise ProtocolError(f"rpc request id {req_id!r} is not an integer in [0, 2**63)")
    if not isinstance(method, str) or len(method) > MAX_METHOD:
        raise ProtocolError(f"rpc method must be a string of at most {MAX_METHOD} characters")
    return Envelope(kind, req_id, method, body)


class _Link:
    """Whether a client's one connection is up, from its socket's monitor. Only two events, each
    once per connection, so the monitor's queue stays short; read on the calling thread.
    ``up_once``: a handshake seen, or any frame received (the monitor is attached after the
    socket connected, so the first handshake may have come before it)."""

    def __init__(self, sock: zmq.Socket, grace_s: float):
        self.grace_s = grace_s
        self.monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.up_once = False
        self.down_since: float | None = None
        self.drops = 0  # connections lost: a reply owed on one of them never comes

    def read(self) -> None:
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.up_once, self.down_since = True, None
            else:
                self.drops += 1
                if self.down_since is None:
                    self.down_since = time.monotonic()

    def lost_for(self, now: float) -> float | None:
        """How long the connection has been down, once that exceeds the grace (a reconnect
        within it, as after a heartbeat missed under load, is not a loss); else None."""
        self.read()
        down = None if self.down_since is None or not self.up_once else now - self.down_since
        return down if down is not None and down > self.grace_s else None


class RpcClient:
    """Calls one server. ``transport.dial`` makes the socket (auth, heartbeats, bounded sends).
    ``lost_after_s``: watch the connection (see the module's doc); None: the deadline decides."""

    def __init__(self, transport, address: str, peer: str, *, max_frame: int, name: str = "",
                 lost_after_s: float | None = None):
        self.address, self.peer, self.name = address, peer, name or f"{peer} at {address}"
        self.max_frame = max_frame
        links: list[_Link] = []
        watch = (lambda sock: links.append(_Link(sock, lost_after_s))) if lost_after_s is not None else None
        try:  # the monitor before connect: over ipc the handshake may complete before it otherwise
            self._sock = transport.dial(zmq.DEALER, address, peer, max_frame=max_frame,
                                        send_slice_ms=int(SLICE_S * 1000), before_connect=watch)
        except BaseException:
            for link in links:
                link.monitor.close(linger=0)
            raise
        self._link = links[0] if links else None
        self._counters = transport.counters.peer(peer)
        # ids start at a random point so a restarted client cannot reuse a recent id
        self._ids = itertools.count(int.from_bytes(os.urandom(6), "little"))
        self._lock = threading.Lock()
        self.discarded = 0
        """Replies dropped because they answered an earlier call (or were malformed)."""

    def call(self, method: str, body: Any, timeout_s: float, frames: tuple = ()) -> Any:
        """Send ``method(body)`` and return the server's answer, or raise ``RpcTimeout`` /
        ``RpcRejected``."""
        with self._lock:
            req_id = next(self._ids) & MAX_REQ_ID
            deadline = time.monotonic() + timeout_s
            self._check_link(method, req_id)
            drops = self._link.drops if self._link is not None else 0
            self._send([encode(Envelope(REQUEST, req_id, method, body)), *frames], method, req_id,
                       deadline, timeout_s)
            env = self._await(req_id, method, deadline, timeout_s, drops)
        if env.kind == ERROR:
            raise RpcRejected(self.name, method, str(env.body))
        return env.body

    def _send(self, frames: list, method: str, req_id: int, deadline: float, timeout_s: float) -> None:
        while True:
            try:
                self._sock.send_multipart(frames, copy=False)
                self._counters.sent_msgs += 1
                self._counters.sent_bytes += sum(len(f) for f in frames)
                return
            except zmq.Again:  # no connection to queue on yet: retry until the deadline
                self._check_link(method, req_id)
                if time.monotonic() >= deadline:
                    raise RpcTimeout(self.name, method, req_id, timeout_s, "send") from None

    def _await(self, req_id: int, method: str, deadline: float, timeout_s: float, drops: int = 0) -> Envelope:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sock.poll(int(min(left, SLICE_S) * 1000) + 1):
                self._check_link(method, req_id)
                if self._link is not None and self._link.drops != drops and self._link.up_once:
                    # the connection this request went out on closed: its reply went with it,
                    # even if a new connection came up within the grace
                    raise RpcLost(self.name, method, req_id, time.monotonic() - (self._link.down_since or time.monotonic()))
                if time.monotonic() >= deadline:
                    raise RpcTimeout(self.name, method, req_id, timeout_s, "reply")
                continue
            frames = self._sock.recv_multipart()
            if self._link is not None:
                self._link.up_once = True
            self._counters.recv_msgs += 1
            self._counters.recv_bytes += sum(len(f) for f in frames)
            try:
                env = decode(frames[0], self.max_frame)
            except ProtocolError as exc:
                self.discarded += 1
                _limited.warning(f"{self.name}: malformed reply", "%s: dropped a malformed reply: %s", self.name, exc)
                continue
            if env.req_id != req_id or env.kind == REQUEST:
                self.discarded += 1  # a late reply to a call that already gave up
                log.debug("%s: dropped a late reply to request %d", self.name, env.req_id)
                continue
            return env

    def _check_link(self, method: str, req_id: int) -> None:
        down = self._link.lost_for(time.monotonic()) if self._link is not None else None
        if down is not None:
            raise RpcLost(self.name, method, req_id, down)

    @property
    def connected_once(self) -> bool | None:
        """Whether the connection ever came up (None: not watched)."""
        if self._link is None:
            return None
        with self._lock:
            self._link.read()
            return self._link.up_once

    def close(self) -> None:
        with self._lock:
            if self._link is not None:
                self._sock.disable_monitor()
                self._link.monitor.close(linger=0)
            self._sock.close(linger=0)


@dataclass
class Call:
    """One request as the handler sees it; ``peer`` is the authenticated sender (or None)."""
    server: "RpcServer"
    route: bytes
    req_id: int
    method: str
    body: Any
    frames: list = field(default_factory=list)
    peer: str | None = None

    def reply(self, value: Any = None, error: str | None = None) -> None:
        self.server.reply(self, value, error)


class RpcServer:
    """Serves ``handler(call) -> value | DEFER`` on one thread until ``close()``. ``tick(now)``,
    if given, runs on the same thread every slice (expiring parked requests)."""

    def __init__(self, transport, host: str, port: int, handler: Callable[[Call], Any], *,
                 name: str, max_frame: int, tick: Callable[[float], None] | None = None):
        self.name, self.max_frame = name, max_frame
        self._handler, self._tick, self._transport = handler, tick, transport
        self._sock, self.address = transport.listen(zmq.ROUTER, host, port, max_frame=max_frame)
        self._wake_tx, self._wake_rx = transport.inproc_pair(f"rpc-{name}")
        self._outbox: collections.deque = collections.deque()
        self._stop = threading.Event()
        self.rejected = 0
        """Requests answered with an error (malformed, refused by the handler, or it failed)."""
        self._thread = threading.Thread(target=self._serve, name=f"commrt-{name}", daemon=True)
        self._thread.start()

    def reply(self, call: Call, value: Any = None, error: str | None = None) -> None:
        env = Envelope(ERROR if error is not None else REPLY, call.req_id, call.method,
                       error if error is not None else value)
        try:
            frames = [call.route, encode(env)]
        except Exception as exc:  # not msgpack's (a handler's bug) or no memory for it: the thread lives on
            _limited.warning(f"{self.name}: unencodable reply", "%s: could not encode the reply to %s: %s",
                             self.name, call.method, exc)
            frames = [call.route, encode(Envelope(ERROR, call.req_id, call.method, f"the reply to {call.method} "
                                                  f"could not be encoded: {type(exc).__name__}: {exc}"[:1000]))]
        if len(frames[1]) > self.max_frame - 64:  # (a proxy re-encodes it with its own id)
            frames[1] = encode(Envelope(ERROR, call.req_id, call.method,
                                        f"the reply to {call.method} ({len(frames[1])} bytes) exceeds the frame "
                                        f"limit of {self.max_frame}: ask for less at once"))
        if threading.current_thread() is self._thread:
            self._send(frames)
        else:  # only the serving thread touches the socket
            self._outbox.append(frames)
            self._wake_tx.send(b"", zmq.NOBLOCK)

    def _send(self, frames: list) -> None:
        try:  # ROUTER drops replies to a vanished peer; NOBLOCK so a slow one never stalls us
            self._sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            log.warning("%s: dropped a reply (the client's queue is full)", self.name)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(int(SLICE_S * 1000)))
                if self._wake_rx in ready:
                    while self._wake_rx.poll(0):
                        self._wake_rx.recv()
                while self._outbox:
                    self._send(self._outbox.popleft())
                if self._sock in ready:
                    self._drain()
                if self._tick is not None:
                    self._guarded(self._tick, time.monotonic())
        finally:
            for s in (self._sock, self._wake_rx):
                s.close(linger=0)

    def _drain(self, batch: int = 256) -> None:
        for _ in range(batch):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._one(frames)

    def _one(self, frames: list) -> None:
        route = frames[0].bytes
        try:
            if len(frames) < 2:
                raise ProtocolError("a request without an envelope")
            env = decode(frames[1].bytes, self.max_frame)
            if env.kind != REQUEST:
                raise ProtocolError(f"rpc kind {env.kind} where a request was expected")
        except ProtocolError as exc:
            self._reject(route, 0, "", exc)
            return
        call = Call(self, route, env.req_id, env.method, env.body, frames[2:],
                    self._transport.peer_of(frames[1]))
        try:
            value = self._handler(call)
        except Exception as exc:  # any failure answers this one request; the thread lives on
            self._reject(route, env.req_id, env.method, exc)
            return
        if value is not DEFER:
            self.reply(call, value)

    def _reject(self, route: bytes, req_id: int, method: str, exc: Exception) -> None:
        self.rejected += 1
        reason = f"{type(exc).__name__}: {exc}"[:1000]
        _limited.warning(f"{self.name}: rejected request", "%s: rejected a request (%s): %s", self.name, method or "?", reason)
        self._send([route, encode(Envelope(ERROR, req_id, method, reason))])

    def _guarded(self, fn: Callable, *args) -> None:
        try:
            fn(*args)
        except Exception:  # a failing tick must not end the service either
            log.exception("%s: periodic task failed", self.name)

    def close(self, within_s: float = 5.0) -> bool:
        """Stop serving and close the socket (on the serving thread). False if the thread did
        not stop in time (its socket is then left to the process's exit)."""
        self._stop.set()
        self._thread.join(within_s)
        if self._thread.is_alive():
            return False
        self._wake_tx.close(linger=0)
        return True
