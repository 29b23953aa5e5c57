"""A small key-value store for bootstrap (like torch's TCPStore), served by rank 0 over ZeroMQ.

Requests and replies are msgpack arrays with strict limits; values are opaque bytes. The
client never blocks without a deadline. Under torchrun the agent already serves a TCPStore
on MASTER_PORT, so ``TorchStore`` adapts that one to the same interface.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

import msgpack
import zmq

from .errors import ProtocolError, RendezvousError

log = logging.getLogger(__name__)

MAX_KEY = 256
MAX_VALUE = 64 << 10
MAX_KEYS = 100_000


class Store(Protocol):
    def set(self, key: str, value: bytes) -> None: ...
    def mget(self, keys: list[str]) -> list[bytes | None]: ...
    def add(self, key: str, amount: int) -> int: ...
    def close(self) -> None: ...


def _decode_request(buf: bytes) -> list:
    try:
        req = msgpack.unpackb(buf, raw=False, max_str_len=MAX_KEY, max_bin_len=MAX_VALUE,
                              max_array_len=1024, max_map_len=0, max_ext_len=0)
    except Exception as exc:
        raise ProtocolError(f"undecodable store request: {exc}") from None
    if not isinstance(req, list) or not req or req[0] not in ("set", "mget", "add"):
        raise ProtocolError("store request must be [op, ...] with op in set|mget|add")
    return req


class StoreServer:
    """Serves the store from a background thread until ``close()``."""

    def __init__(self, ctx: zmq.Context, host: str, port: int, guard=None):
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_VALUE + 4096)
        if guard is not None:
            guard.server(self._sock)
        try:
            self._sock.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as exc:
            self._sock.close()
            raise RendezvousError(f"cannot serve rendezvous on {host}:{port}: {exc}") from None
        self._data: dict[str, bytes | int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="commrt-store", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(100):
                continue
            frames = self._sock.recv_multipart()
            if len(frames) != 2:
                continue
            try:
                reply = self._handle(_decode_request(frames[1]))
            except (ProtocolError, TypeError, ValueError) as exc:
                log.warning("store: rejected a request: %s", exc)
                reply = ["error", str(exc)]
            self._sock.send_multipart([frames[0], msgpack.packb(reply, use_bin_type=True)])
        self._sock.close(linger=0)

    def _handle(self, req: list):
        op = req[0]
        if op == "set":
            _, key, value = req
            if not isinstance(value, bytes) or not isinstance(key, str):
                raise TypeError("set needs a str key and a bytes value")
            self._insert(key, value)
            return ["ok"]
        if op == "add":
            _, key, amount = req
            value = int(self._data.get(key, 0)) + int(amount)
            self._insert(key, value)
            return ["ok", value]
        return ["ok", [self._data.get(k) if isinstance(k, str) else None for k in req[1]]]

    def _insert(self, key: str, value) -> None:
        if key not in self._data and len(self._data) >= MAX_KEYS:
            raise ValueError(f"store is full ({MAX_KEYS} keys)")
        self._data[key] = value

    def close(self, linger_s: float = 0.0) -> None:
        """Stop serving; ``linger_s`` keeps answering a little longer (after a failed
        rendezvous, so the other ranks can still read why)."""
        if linger_s:
            time.sleep(linger_s)
        self._stop.set()
        self._thread.join(2.0)


class StoreClient:
    def __init__(self, ctx: zmq.Context, host: str, port: int, timeout_s: float, guard=None):
        self.where = f"{host}:{port}"
        self.timeout_s = timeout_s
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # a DEALER whose only connection was refused (a wrong secret or key) has no pipe left to
        # queue on, and its send would block for ever: bound it like every other wait
        self._sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
        if guard is not None:
            guard.client(self._sock, "rank0")
        self._sock.connect(f"tcp://{host}:{port}")
        self._lock = threading.Lock()

    def _call(self, *req):
        with self._lock:
            try:
                self._sock.send(msgpack.packb(list(req), use_bin_type=True))
            except zmq.Again:
                raise RendezvousError(f"rendezvous store at {self.where} took no request within "
                                      f"{self.timeout_s:g}s (is rank 0 running, under the same [security] "
                                      "mode and job secret or keys? a refused handshake is silent)") from None
            if not self._sock.poll(int(self.timeout_s * 1000)):
                raise RendezvousError(f"rendezvous store at {self.where} did not answer within "
                                      f"{self.timeout_s:g}s (is rank 0 running, under the same [security] mode "
                                      "and job secret or keys? a stranger's handshake is refused silently)")
            reply = msgpack.unpackb(self._sock.recv(), raw=False)
        if reply[0] != "ok":
            raise RendezvousError(f"rendezvous store refused {req[0]}: {reply[1]}")
        return reply[1] if len(reply) > 1 else None

    def set(self, key: str, value: bytes) -> None:
        self._call("set", key, value)

    def mget(self, keys: list[str]) -> list[bytes | None]:
        return self._call("mget", keys)

    def add(self, key: str, amount: int) -> int:
        return self._call("add", key, amount)

    def close(self) -> None:
        self._sock.close(linger=0)


class TorchStore:
    """Adapter: a torch.distributed Store (e.g. torchrun's agent TCPStore) as our Store."""

    def __init__(self, store, prefix: str = "commrt/"):
        self._store, self._prefix = store, prefix

    def set(self, key: str, value: bytes) -> None:
        self._store.set(self._prefix + key, value)

    def mget(self, keys: list[str]) -> list[bytes | None]:
        return [self._store.get(self._prefix + k) if self._store.check([self._prefix + k]) else None
                for k in keys]

    def add(self, key: str, amount: int) -> int:
        return self._store.add(self._prefix + key, amount)

    def close(self) -> None:
        pass


def wait_for(store: Store, keys: list[str], timeout_s: float, what: str,
             abort_key: str | None = None) -> list[bytes]:
    """Poll until every key exists; on timeout, name the missing ones."""
    deadline = time.monotonic() + timeout_s
    probe = keys + ([abort_key] if abort_key else [])
    while True:
        values = store.mget(probe)
        if abort_key and values[-1] is not None:
            raise RendezvousError(values[-1].decode(errors="replace"))
        values = values[:len(keys)]
        missing = [k for k, v in zip(keys, values) if v is None]
        if not missing:
            return values
        if time.monotonic() > deadline:
            raise RendezvousError(f"{what}: still missing after {timeout_s:g}s: {missing}")
        time.sleep(0.01)
