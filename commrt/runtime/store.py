"""A small key-value store for bootstrap (like torch's TCPStore), served by rank 0 over the
transport's request/reply channel (``transport/rpc.py``); the logic is ``store_core.StoreCore``.

Every request carries the store's incarnation token (drawn when rank 0 starts serving), so a
client of an earlier ``init_process_group`` cannot talk to a later store, and a re-initialising
client refuses the previous store while it is still up. Waits are parked in the store and
answered when they can be, so ranks do not poll. A zmq world of several nodes reaches it through
one proxy per node (``store_proxy.py``; ``StoreClient(via=...)``). Under torchrun the agent
already serves a TCPStore on MASTER_PORT; ``TorchStore`` adapts it to the same interface.
"""
from __future__ import annotations

import time

import zmq

from commrt.runtime import addresses
from commrt.runtime.errors import RendezvousError
from commrt.runtime.store_core import ABORT, MAX_FRAME, OK, TIMEOUT, StoreCore
from commrt.transport.rpc import DEFER, Call, RpcClient, RpcLost, RpcRejected, RpcServer, RpcTimeout

# -- over the network ------------------------------------------------------------------------

class StoreServer:
    """Serves a ``StoreCore`` on the rpc server's one thread until ``close()``."""

    def __init__(self, transport, host: str, port: int, bind_within_s: float = 10.0):
        self.core = StoreCore()
        self._routes: set[bytes] = set()  # one per connection that sent a request (issue 32.5)
        deadline = time.monotonic() + bind_within_s
        while True:
            try:
                self._rpc = RpcServer(transport, host, port, self._handle, name="store",
                                      max_frame=MAX_FRAME, tick=self._tick)
                return
            except zmq.ZMQError as exc:
                # a store closed a moment ago (destroy, then init again) releases its port in
                # ZeroMQ's I/O thread, asynchronously: give it a little time
                if exc.errno != zmq.EADDRINUSE or time.monotonic() >= deadline:
                    raise RendezvousError(f"cannot serve rendezvous on {host}:{port}: {exc}") from None
                time.sleep(0.05)

    def _handle(self, call: Call):
        self._routes.add(call.route)
        reply = self.core.handle(call.method, call.body, call, time.monotonic())
        self._flush()
        return DEFER if reply is None else reply

    def _tick(self, now: float) -> None:
        self.core.expire(now)
        self._flush()

    def _flush(self) -> None:
        for call, reply in self.core.take_answered():
            if isinstance(reply, Exception):
                call.reply(error=f"{type(reply).__name__}: {reply}")
            else:
                call.reply(reply)

    @property
    def rejected(self) -> int:
        return self._rpc.rejected

    @property
    def connections(self) -> int:
        """Connections this store has served requests on since it started: one per rank, or
        one per node's store proxy (store_proxy.py) plus rank 0's node's ranks."""
        return len(self._routes)

    def close(self, linger_s: float = 0.0) -> None:
        """Stop serving; ``linger_s`` keeps answering a little longer (after a failed
        rendezvous, so the other ranks can still read why)."""
        if linger_s:
            time.sleep(linger_s)
        self._rpc.close()


# incarnations of stores this process has finished with, per address: a re-initialising rank
# must not rejoin the previous store while rank 0 has not yet replaced it (issue 13.4)
retired: dict[str, set[int]] = {}
HELLO_TRY_S = 1.0  # one handshake attempt: short, so a request lost in a closing store is retried


class NoProxy(RendezvousError):
    """No store proxy answered on this node within the wait for one (store_proxy.connect)."""


class StoreClient:
    """Talks to rank 0's store. Construction performs the handshake (bounded by ``timeout_s``).
    ``via``: (address, serving rank's name, who it is) of this node's store proxy
    (``store_proxy.py``), which forwards every call to the store at ``host:port``; its
    connection is watched, so a call fails within a heartbeat interval (``RendezvousError``
    naming the proxy and the op) once the proxy is gone. ``absent_s``: with ``via``, raise
    ``NoProxy`` when no proxy's connection came up within that long."""

    def __init__(self, transport, host: str, port: int, timeout_s: float,
                 via: tuple[str, str, str] | None = None, absent_s: float | None = None):
        self.where, self.timeout_s = addresses.join(host, port), timeout_s
        address, peer, self.via = via or (addresses.tcp_url(host, port), "rank0", "")
        self.name = f"rendezvous store at {self.where}" + (f" via {self.via}" if self.via else "")
        self._rpc = RpcClient(transport, address, peer, max_frame=MAX_FRAME, name=self.name,
                              lost_after_s=transport.cfg.comm.heartbeat_s if self.via else None)
        try:
            self.incarnation = self._handshake(absent_s if self.via else None)
        except BaseException:
            self._rpc.close()
            raise

    def _handshake(self, absent_s: float | None) -> int:
        start = time.monotonic()
        deadline = start + self.timeout_s
        old = retired.get(self.where, set())
        stale = None  # the last answer came from a store this process has finished with
        while True:
            left = deadline - time.monotonic()
            try:
                answer = self._rpc.call("hello", [], min(max(left, 0.01), HELLO_TRY_S))[1]
                if answer not in old:
                    return answer
                stale = True
            except RpcTimeout as exc:
                stale = exc
            except (RpcRejected, RpcLost) as exc:
                # a proxy whose upstream is down refuses at once: across a re-initialisation it
                # was connected to the previous store, which closed (test_estimate's second run
                # failed so); it reconnects to the new one, so try again until the deadline. So
                # does a client whose proxy was the previous one's, closed since (lost)
                if not self.via:
                    raise
                stale = exc
            if absent_s is not None and time.monotonic() - start >= absent_s and not self._rpc.connected_once:
                raise NoProxy(f"{self.via} did not answer within {absent_s:g}s (none is listening yet)")
            if time.monotonic() >= deadline:
                if isinstance(stale, RpcTimeout):
                    raise RendezvousError(self._unreachable(stale)) from None
                if isinstance(stale, RpcRejected):
                    raise RendezvousError(f"{self.name} refused hello for {self.timeout_s:g}s: {stale.reason}") from None
                if isinstance(stale, RpcLost):
                    raise RendezvousError(f"{self.name} lost its connection during hello: {self.via} exited") from None
                raise RendezvousError(f"{self.name} is still the one of an earlier "
                                      f"init_process_group after {self.timeout_s:g}s (rank 0 has not "
                                      "re-initialised)")
            if stale is True or isinstance(stale, (RpcRejected, RpcLost)):
                time.sleep(0.05)  # the previous store is still up, or the proxy's link is not back yet

    def _unreachable(self, exc: RpcTimeout) -> str:
        how = "no connection took the request" if exc.phase == "send" else "no reply"
        who = self.via or "rank 0"
        return (f"{self.name} did not answer within {self.timeout_s:g}s ({how}; is {who} running, "
                "under the same [security] mode and job secret or keys? a refused handshake is silent)")

    def _call(self, method: str, *args, wait_s: float = 0.0, timeout_s: float | None = None):
        # a parked wait is answered by the server at its deadline; allow for the trip back
        budget = wait_s + (self.timeout_s if timeout_s is None else timeout_s)
        try:
            reply = self._rpc.call(method, [self.incarnation, *args], budget)
        except RpcTimeout as exc:
            gone = (f"{self.via} exited (its node's ranks reach rank 0's store only through it) or rank 0 did"
                    if self.via else "rank 0 exited or is overloaded")
            raise RendezvousError(f"{self.name} stopped answering ({method}, {exc.waited_s:g}s): {gone}") from None
        except RpcLost as exc:  # watched only through a proxy: its leader's death ends the node's access
            raise RendezvousError(f"{self.name} lost its connection {exc.down_s:.1f}s ago ({method}): {self.via} "
                                  "exited or stopped answering heartbeats (its node's ranks reach rank 0's "
                                  "store only through it)") from None
        except RpcRejected as exc:
            raise RendezvousError(f"{self.name} refused {method}: {exc.reason}") from None
        return reply

    def set(self, key: str, value: bytes) -> None:
        self._call("set", key, value)

    def mget(self, keys: list[str]) -> list:
        return self._call("mget", keys)[1]

    def add(self, key: str, amount: int, timeout_s: float | None = None) -> int:
        """``timeout_s``: this call's bound (default: the store's), for a call that may find
        rank 0 already gone and need not wait the job's whole timeout to learn it."""
        return self._call("add", key, amount, timeout_s=timeout_s)[1]

    def wait(self, keys: list[str], abort_key: str | None, timeout_s: float) -> list:
        """[ok, values] | [abort, message] | [timeout, missing keys], answered by the store."""
        return self._call("wait", keys, abort_key, timeout_s, wait_s=timeout_s)

    def wait_count(self, key: str, target: int, abort_key: str | None, timeout_s: float) -> list:
        """[ok, value] | [abort, message] | [timeout, value]: counter ``key`` reached ``target``."""
        return self._call("wait_count", key, target, abort_key, timeout_s, wait_s=timeout_s)

    def add_wait_count(self, key: str, amount: int, target: int, abort_key: str | None, timeout_s: float) -> list:
        """Add ``amount`` to counter ``key``, then wait for it to reach ``target``, in one round
        trip: [ok | abort | timeout, value or message, the value right after this add]."""
        return self._call("add_wait_count", key, amount, target, abort_key, timeout_s, wait_s=timeout_s)

    def close(self) -> None:
        retired.setdefault(self.where, set()).add(self.incarnation)
        self._rpc.close()


class TorchStore:
    """Adapter: a torch.distributed Store (e.g. torchrun's agent TCPStore) as our Store. It has
    no parked waits, so ``wait``/``wait_count`` poll with a growing interval."""

    def __init__(self, store, prefix: str = "commrt/"):
        self._store, self._prefix = store, prefix

    def set(self, key: str, value: bytes) -> None:
        self._store.set(self._prefix + key, value)

    def mget(self, keys: list[str]) -> list[bytes | None]:
        return [self._store.get(self._prefix + k) if self._store.check([self._prefix + k]) else None
                for k in keys]

    def add(self, key: str, amount: int, timeout_s: float | None = None) -> int:
        """(torch's store bounds every call by its own timeout: ``timeout_s`` is not applied)"""
        return self._store.add(self._prefix + key, amount)

    def _poll(self, probe, abort_key: str | None, timeout_s: float) -> list:
        deadline, pause = time.monotonic() + timeout_s, 0.005
        while True:
            if abort_key and self._store.check([self._prefix + abort_key]):
                return [ABORT, self._store.get(self._prefix + abort_key)]
            done, value = probe()
            if done:
                return [OK, value]
            if time.monotonic() >= deadline:
                return [TIMEOUT, value]
            time.sleep(pause)
            pause = min(pause * 2, 0.2)

    def wait(self, keys: list[str], abort_key: str | None, timeout_s: float) -> list:
        def probe():
            values = self.mget(keys)
            missing = [k for k, v in zip(keys, values) if v is None]
            return (not missing), (values if not missing else missing)
        return self._poll(probe, abort_key, timeout_s)

    def wait_count(self, key: str, target: int, abort_key: str | None, timeout_s: float) -> list:
        def probe():
            value = self.add(key, 0)
            return value >= target, value
        return self._poll(probe, abort_key, timeout_s)

    def add_wait_count(self, key: str, amount: int, target: int, abort_key: str | None, timeout_s: float) -> list:
        added = self.add(key, amount)  # torch's store has no such call: two requests
        return [*self.wait_count(key, target, abort_key, timeout_s), added]

    def close(self) -> None:
        pass


def wait_for(store, keys: list[str], timeout_s: float, what: str, abort_key: str | None = None) -> list[bytes]:
    """The values of ``keys`` once they all exist (the store answers when they do); an abort
    message or the deadline becomes a ``RendezvousError`` naming what is missing."""
    status, value = store.wait(keys, abort_key, timeout_s)
    if status == ABORT:
        raise RendezvousError(bytes(value).decode(errors="replace"))
    if status == TIMEOUT:
        shown = ", ".join(value[:8]) + (f" and {len(value) - 8} more" if len(value) > 8 else "")
        raise RendezvousError(f"{what}: {len(value)} key(s) still missing after {timeout_s:g}s: {shown}")
    return value
