"""A store per node (issue 32.5): the node's leader (local rank 0) serves a proxy of rank 0's
bootstrap store on its node, and the node's ranks talk to it, so rank 0's store holds one
connection per node instead of one per rank (16,384 at 128 nodes of 128 ranks: ~160 MB of
ZeroMQ buffers on rank 0 alone).

The proxy listens on a Unix socket in the abstract namespace (``Transport.listen_local``: on
this node only, authenticated exactly as the store is; its name is derived from the job secret,
so a process without it cannot squat on it), and forwards every request over one upstream
connection. It multiplexes: each request gets a fresh upstream id, so parked waits (``wait``,
``wait_count``, ``add_wait_count``) go on concurrently, never behind each other. Every forwarded
request keeps a deadline (its own wait plus most of ``timeout_s``, so the proxy's answer reaches
the client before the client gives up); a deadline passed, or the upstream connection lost, is
answered with an error naming the store, the op and this proxy, which the client raises as a
``RendezvousError``. A node whose leader dies cannot reach the store at all: its ranks' store
calls fail within a heartbeat interval of its death (their client watches the connection to
the proxy), naming the proxy, its rank and the op; there is no fall-back to rank 0 then. At
init only, a rank that finds no proxy on its node within ``ABSENT_S`` connects to rank 0's
store itself (logged): its leader may run with ``[cluster] store_proxy = false`` while it has
true, and only through the store can it get the config digest error that says so.

Used by the zmq world with node hints and more than one node (``use_proxy``); gloo/nccl and
torchrun's agent store keep one connection per rank.
"""
from __future__ import annotations

import hashlib
import itertools
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

from commrt.runtime import addresses
from commrt.runtime.errors import ProtocolError, RendezvousError
from commrt.runtime.store import NoProxy, StoreClient, retired
from commrt.runtime.store_core import MAX_FRAME, MAX_WAIT_S
from commrt.transport import security
from commrt.transport.rpc import ERROR, MAX_REQ_ID, REQUEST, SLICE_S, Envelope, decode, encode

log = logging.getLogger(__name__)

WAITS = ("wait", "wait_count", "add_wait_count")  # their last argument is how long they park
CLIENT_SHARE = 0.75  # of timeout_s: the proxy gives up on a reply before its client does
DRAIN_MS = 1000
ABSENT_S = 10.0  # how long a rank waits at init for its node's proxy before it dials the store itself


def use_proxy(enabled: bool, backend: str, hint: list[int] | None, world_size: int,
              agent_store: bool) -> bool:
    """Whether this rank's world goes through store proxies: only where it is known safe (a
    zmq world, node hints from the launcher, more than one node, our own store, Linux)."""
    return (enabled and backend == "zmq" and hint is not None and not agent_store
            and hint[2] < world_size and sys.platform.startswith("linux"))


def proxy_name(secret: bytes, host: str, port: int, node: int) -> str:
    """The abstract socket name of ``node``'s proxy for the store at ``host:port``: every rank
    of the node computes it alone; without the job secret it cannot be guessed. Every local
    user can list it (/proc/net/unix), so it comes from the stretched secret (security.derive):
    a fast hash of it would test guesses at a user-chosen secret offline, millions a second.
    Without a secret (curve, none) there is nothing to hide and nothing to stretch."""
    where = f"store-proxy|{host}|{port}|{node}"
    digest = security.derive(secret, where) if secret else hashlib.sha256(where.encode()).hexdigest()
    return f"commrt-store-{digest[:24]}"


def forward_deadline(method: str, body, now: float, timeout_s: float) -> float:
    """When the proxy stops waiting for the store's answer to ``method(body)``: after the wait
    the request itself asks for (bounded as the store bounds it), plus most of ``timeout_s``."""
    wait_s = body[-1] if method in WAITS and isinstance(body, list) and body else 0.0
    if type(wait_s) not in (int, float) or not 0 <= wait_s <= MAX_WAIT_S:  # NaN fails too
        wait_s = 0.0  # the store refuses such a request at once
    return now + wait_s + CLIENT_SHARE * timeout_s


def connect(transport, host: str, port: int, rank: int, timeout_s: float,
            node: list[int] | None) -> tuple[StoreClient, "StoreProxy | None"]:
    """This rank's client of the store at ``host:port``, and the proxy it serves (or None).
    ``node``: its node hint ([node, local rank, local ranks]) when its world goes through
    proxies; a node other than rank 0's (node 0, which talks to the store directly) then talks
    to the proxy its local rank 0 serves, that rank included."""
    if node is None or node[0] == 0:
        return StoreClient(transport, host, port, timeout_s), None
    proxy = None
    if node[1] == 0:
        try:
            proxy = StoreProxy(transport, host, port, node[0], rank, timeout_s)
        except RendezvousError as exc:
            # its name is taken (under curve it is public: a local process may squat on it);
            # the node's ranks find no proxy and dial the store themselves (NoProxy below)
            log.warning("rank %d: %s; connecting to the rendezvous store at %s:%d directly", rank, exc, host, port)
            return StoreClient(transport, host, port, timeout_s), None
    leader = rank - node[1]  # a node's ranks are contiguous (the rendezvous checks it)
    address = f"ipc://@{proxy_name(transport.guard.secret, host, port, node[0])}"
    absent_s = min(ABSENT_S, timeout_s / 2)
    try:
        try:
            return StoreClient(transport, host, port, timeout_s, absent_s=absent_s,
                               via=(address, f"rank{leader}", f"the store proxy of node {node[0]} on rank {leader}")), proxy
        except NoProxy as exc:
            # its leader is late, or serves no proxy (its config disagrees: the rendezvous
            # compares digests and names the rank); either way the store decides
            log.warning("rank %d: %s; connecting to the rendezvous store at %s:%d directly", rank, exc, host, port)
            return StoreClient(transport, host, port, timeout_s), proxy
    except BaseException:
        if proxy is not None:
            proxy.close()
        raise


def _listen(transport, name: str, within_s: float = 10.0):
    deadline = time.monotonic() + within_s
    while True:
        try:
            return transport.listen_local(zmq.ROUTER, name, max_frame=MAX_FRAME)
        except zmq.ZMQError as exc:
            # a proxy closed a moment ago (destroy, then init again) releases its name in
            # ZeroMQ's I/O thread, asynchronously: give it a little time, as the store does
            if exc.errno != zmq.EADDRINUSE or time.monotonic() >= deadline:
                raise RendezvousError(f"cannot serve the node's store proxy on ipc://@{name}: {exc}") from None
            time.sleep(0.05)


@dataclass
class _Pending:
    route: bytes
    req_id: int
    method: str
    deadline: float


class StoreProxy:
    """Serves ``node``'s proxy on its own thread until ``close()``; ``rank``: the leader."""

    def __init__(self, transport, host: str, port: int, node: int, rank: int, timeout_s: float):
        self.upstream, self.node, self.rank, self.timeout_s = f"{host}:{port}", node, rank, timeout_s
        self.who = f"the store proxy of node {node} on rank {rank}"
        self._down, self.address = _listen(transport, proxy_name(transport.guard.secret, host, port, node))
        try:
            self._up = transport.dial(zmq.DEALER, addresses.tcp_url(host, port), "rank0", max_frame=MAX_FRAME)
            self._events = self._up.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        except BaseException:
            self._down.close(linger=0)
            raise
        self._ids = itertools.count(int.from_bytes(os.urandom(6), "little"))
        self._pending: dict[int, _Pending] = {}
        self._routes: set[bytes] = set()
        self._lost = False  # the upstream connection dropped and is not back
        self.incarnation = None  # the store's, from the first hello answered: a later store's is refused
        self.forwarded = self.failed = self.discarded = 0
        self._stop = threading.Event()
        first = next(self._ids) & MAX_REQ_ID
        try:
            self._up.send_multipart([encode(Envelope(REQUEST, first, "hello", []))], zmq.NOBLOCK)
            self._pending[first] = _Pending(b"", 0, "hello", forward_deadline("hello", [], time.monotonic(), timeout_s))
        except zmq.Again:
            pass
        self._thread = threading.Thread(target=self._serve, name=f"commrt-store-proxy{node}", daemon=True)
        self._thread.start()

    def stats(self) -> dict:
        return {"node": self.node, "clients": len(self._routes), "forwarded": self.forwarded,
                "failed": self.failed}

    # -- the serving thread (it alone touches the three sockets) ---------------------------------
    def _serve(self) -> None:
        poller = zmq.Poller()
        for s in (self._down, self._up, self._events):
            poller.register(s, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(int(SLICE_S * 1000)))
                if self._events in ready:
                    self._on_events()
                if self._up in ready:
                    self._drain(self._up, self._from_store)
                if self._down in ready:
                    self._drain(self._down, self._from_client)
                self._expire(time.monotonic())
        except Exception:  # the proxy's death must not be silent: its clients then time out
            log.exception("%s: stopped", self.who)
        finally:
            self._up.disable_monitor()
            for s in (self._events, self._up):
                s.close(linger=0)
            # answers already passed on (the last ones at shutdown) still reach their ranks;
            # the context's end waits at most this long for a client that is gone
            self._down.close(linger=DRAIN_MS)

    @staticmethod
    def _drain(sock: zmq.Socket, handle, batch: int = 256) -> None:
        for _ in range(batch):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            handle(frames)

    def _from_client(self, frames: list) -> None:
        route = frames[0]
        try:
            if len(frames) < 2:
                raise ProtocolError("a request without an envelope")
            env = decode(frames[1], MAX_FRAME)
            if env.kind != REQUEST:
                raise ProtocolError(f"rpc kind {env.kind} where a request was expected")
        except ProtocolError as exc:
            self._answer(route, 0, "", f"{type(exc).__name__}: {exc}")
            return
        self._routes.add(route)
        if self._lost:
            self._answer(route, env.req_id, env.method, self._gone(env.method))
            return
        up_id = next(self._ids) & MAX_REQ_ID
        deadline = forward_deadline(env.method, env.body, time.monotonic(), self.timeout_s)
        request = encode(Envelope(REQUEST, up_id, env.method, env.body))
        if len(request) > MAX_FRAME:
            self._answer(route, env.req_id, env.method, f"{env.method}: a request of {len(request)} bytes exceeds the "
                         f"limit of {MAX_FRAME}")
            return
        try:
            self._up.send_multipart([request, *frames[2:]], zmq.NOBLOCK)
        except zmq.Again:  # no connection to queue on, or its queue is full
            self._answer(route, env.req_id, env.method,
                         f"{self.who} could not pass {env.method} on to the rendezvous store at {self.upstream}")
            return
        self._pending[up_id] = _Pending(route, env.req_id, env.method, deadline)
        self.forwarded += 1

    def _from_store(self, frames: list) -> None:
        try:
            env = decode(frames[0], MAX_FRAME)
        except ProtocolError:
            env = None
        p = self._pending.pop(env.req_id, None) if env is not None and env.kind != REQUEST else None
        if p is None:  # malformed, or late: its client was already answered
            self.discarded += 1
            return
        if p.method == "hello" and env.kind != ERROR and isinstance(env.body, list) and len(env.body) > 1:
            if env.body[1] in retired.get(self.upstream, ()):
                pass  # a store this process has finished with: its client refuses it anyway
            elif self.incarnation is None:
                self.incarnation = env.body[1]
            elif env.body[1] != self.incarnation:
                # our upstream reconnected to the store of a later init_process_group (rank 0
                # re-initialised while this proxy's leader is still shutting down): its ranks
                # must wait for the leader's next proxy, not park requests in this one
                self._answer(p.route, p.req_id, p.method, f"{self.who} serves an earlier store at {self.upstream}")
                return
        if p.route:
            self._send([p.route, encode(Envelope(env.kind, p.req_id, p.method, env.body)), *frames[1:]])

    def _on_events(self) -> None:
        while self._events.poll(0):
            event = recv_monitor_message(self._events)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._lost = False
            elif event == zmq.EVENT_DISCONNECTED:
                # a parked wait's answer would go to the old connection: fail them all now
                self._lost = True
                for p in self._pending.values():
                    self._answer(p.route, p.req_id, p.method, self._gone(p.method))
                self._pending.clear()

    def _gone(self, method: str) -> str:
        return (f"{self.who} lost its connection to the rendezvous store at {self.upstream} "
                f"({method}): rank 0 exited or the network failed")

    def _expire(self, now: float) -> None:
        late = [k for k, p in self._pending.items() if p.deadline <= now]
        for k in late:
            p = self._pending.pop(k)
            self._answer(p.route, p.req_id, p.method,
                         f"the rendezvous store at {self.upstream} did not answer {p.method} in time "
                         f"(forwarded by {self.who}): rank 0 is overloaded or gone")

    def _answer(self, route: bytes, req_id: int, method: str, error: str) -> None:
        if not route:  # the proxy's own hello
            return
        self.failed += 1
        self._send([route, encode(Envelope(ERROR, req_id, method, error[:1000]))])

    def _send(self, frames: list) -> None:
        try:  # ROUTER drops replies to a vanished client; NOBLOCK so a slow one never stalls us
            self._down.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            log.warning("%s: dropped a reply (the client's queue is full)", self.who)

    def close(self, linger_s: float = 0.0, within_s: float = 5.0) -> None:
        """Stop serving (its node's ranks' store calls fail from then on); ``linger_s`` keeps
        forwarding a little longer (after a failed rendezvous, so the node's ranks still get
        the abort the store sent them: closing drops the replies not yet sent)."""
        if linger_s:
            time.sleep(linger_s)
        self._stop.set()
        self._thread.join(within_s)
