"""Which process holds each worker id on a shard: two processes under one id (a launcher that
started a rank twice, a worker restarted while the first still runs) would otherwise be one
worker to the shard, each replacing the other's parked push and taking the other's clock.

Every client process draws a nonce at start and sends it with each request (ps/protocol.py).
A shard binds a worker id to the first nonce it hears under it (after a shard restart: the
first again, which is the running process, re-sending what the restart lost). A request under
another nonce is refused, naming the worker, unless it is an ``init`` and the holder's
connection to this shard is gone: the holder died (or closed), and the new process replaces
it. What the old one left parked is then void (a restarted worker resumes at its clock here
and pushes that step again), so no push of it is applied after the new one came in.

ps-lite does the same with its heartbeats: a recovering node takes over the id of a node it
considers dead, never one that is alive. A holder counts as alive while its connection is
open: a killed process's connection closes at once, a frozen host's when the transport's
heartbeat gives up on it. A holder that replaced its socket after an error and has not spoken
on the new one yet looks gone: a second process may then take its id, and the first is refused
at its next request (loudly, never mixed in).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

from commrt.ps import protocol as P
from commrt.runtime.errors import ProtocolError

ADVICE = "two processes cannot share a worker id: give each its own ([cluster] rank or RANK)"


class Holder(NamedTuple):
    nonce: int
    ident: bytes  # its latest connection to this shard (a ROUTER identity)


class Incarnations:
    """``connected(ident)``: whether that connection to the shard is still open (the server
    asks its socket; without one, every connection counts as open)."""

    def __init__(self, connected: Callable[[bytes], bool] | None = None):
        self._held: dict[int, Holder] = {}
        self._connected = connected or (lambda ident: True)

    def claim(self, ident: bytes, req: P.Request) -> bool:
        """Bind ``req.worker`` to ``req.nonce`` or raise ProtocolError; True when the request
        replaces a holder that is gone (the caller voids what that one left parked)."""
        held = self._held.get(req.worker)
        if held is None or held.nonce == req.nonce:
            self._held[req.worker] = Holder(req.nonce, ident)
            return False
        if req.op == P.INIT and not self._connected(held.ident):
            self._held[req.worker] = Holder(req.nonce, ident)
            return True
        if req.op == P.INIT:
            raise ProtocolError(f"worker {req.worker} is held by another process whose connection to this "
                                f"server is open: {ADVICE} (a restarted worker is admitted once its "
                                "predecessor's connection has closed)")
        raise ProtocolError(f"worker {req.worker} is held by another process here (this one was replaced "
                            f"by a newer process under the same id, or runs beside it): {ADVICE}")
