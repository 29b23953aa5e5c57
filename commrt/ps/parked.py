"""Requests a server shard holds until they can be answered, indexed so that no call scans them
all: a waiting pull sits in a heap by the clock level it needs (serving costs O(log n) per pull
served), pings find their request by (worker, request id), and the worker-loss check reads only
the oldest requests (arrival order). A request leaves by ``remove``; the heap and the arrival
queue drop removed entries lazily when they reach the front.

Without the index, 4,000 parked far-future pulls took 50 s of server CPU and slowed every
legitimate push_pull 100-fold (issue 13, item 9); a per-worker bound keeps the count small too.
"""
from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools

from commrt.runtime.errors import ProtocolError
from commrt.ps import protocol as P

MAX_WAITING = 16  # pulls and inits one worker may have parked: a client has one in flight per server


@dataclasses.dataclass(eq=False)
class Parked:
    ident: bytes
    req: P.Request
    since: float
    grads: list | None = None  # pushes: one array per segment
    clock: int = 0  # pulls: the worker's clock
    init: tuple | None = None  # inits: (segments, shapes) as described, checked at the seed
    live: bool = True


class Waiting:
    def __init__(self) -> None:
        self.pushes: dict[tuple[int, int], Parked] = {}  # (worker, step); bounded by MAX_AHEAD
        self.inits: list[Parked] = []
        self._pulls: list[tuple[int, int, Parked]] = []  # heap of (level needed, arrival, request)
        self._by_id: dict[tuple[int, int], Parked] = {}
        self._arrivals: collections.deque[Parked] = collections.deque()
        self._held = collections.Counter()  # worker -> parked pulls and inits
        self._order = itertools.count()
        self._dead = 0  # removed pulls still in the heap

    def _add(self, p: Parked) -> None:
        self._by_id[(p.req.worker, p.req.req_id)] = p
        self._arrivals.append(p)

    def _check_room(self, worker: int) -> None:
        if self._held[worker] >= MAX_WAITING:
            raise ProtocolError(f"worker {worker} already has {MAX_WAITING} requests parked on this "
                                "server; refusing more until they are answered")

    def park_push(self, p: Parked) -> None:
        old = self.pushes.get((p.req.worker, p.req.step))
        if old is not None:  # a re-send replaces the routing
            self.remove(old)
        self.pushes[(p.req.worker, p.req.step)] = p
        self._add(p)

    def park_pull(self, p: Parked, level: int, bounded: bool = True) -> None:
        """``level``: the slowest live worker's clock at which it may be served. ``bounded``
        False for the pull half of a push_pull, which its push already paid for."""
        if bounded:
            self._check_room(p.req.worker)
        self._held[p.req.worker] += 1
        heapq.heappush(self._pulls, (level, next(self._order), p))
        self._add(p)

    def park_init(self, p: Parked) -> None:
        self._check_room(p.req.worker)
        self._held[p.req.worker] += 1
        self.inits.append(p)
        self._add(p)

    def remove(self, p: Parked) -> None:
        if not p.live:
            return
        self._forget(p)
        self._trim()
        if p.grads is not None:
            if self.pushes.get((p.req.worker, p.req.step)) is p:
                del self.pushes[(p.req.worker, p.req.step)]
            p.grads = []  # never applied: let its frames go now, not when the queue front passes
        elif p.init is not None:
            self.inits.remove(p)
        else:  # a pull: still in the heap until it reaches the top
            self._dead += 1
            if self._dead > 64 and 2 * self._dead > len(self._pulls):  # keep the heap proportional
                self._pulls = [e for e in self._pulls if e[2].live]
                heapq.heapify(self._pulls)
                self._dead = 0

    def _trim(self) -> None:
        while self._arrivals and not self._arrivals[0].live:
            self._arrivals.popleft()

    def _forget(self, p: Parked) -> None:
        p.live = False
        key = (p.req.worker, p.req.req_id)
        if self._by_id.get(key) is p:
            del self._by_id[key]
        if p.grads is None:
            self._held[p.req.worker] -= 1

    def take_push(self, key: tuple[int, int]) -> Parked:
        """The push of (worker, step), no longer waiting; its gradients stay for the caller."""
        p = self.pushes.pop(key)
        self._forget(p)
        self._trim()
        return p

    def ready_pulls(self, level: int) -> list[Parked]:
        """Remove and return the pulls that need at most ``level``, oldest first per level."""
        out = []
        while self._pulls and (self._pulls[0][0] <= level or not self._pulls[0][2].live):
            p = heapq.heappop(self._pulls)[2]
            if p.live:
                self._forget(p)
                out.append(p)
            else:
                self._dead -= 1
        self._trim()
        return out

    def waiting(self, worker: int, req_id: int) -> bool:
        return (worker, req_id) in self._by_id

    def older_than(self, t: float) -> list[Parked]:
        """The live requests that arrived before ``t`` (reads only the front of the queue)."""
        self._trim()
        out = []
        for p in self._arrivals:
            if p.since >= t:
                break
            if p.live:
                out.append(p)
        return out

    def all(self) -> list[Parked]:
        return [p for p in self._arrivals if p.live]

    def counts(self) -> dict[str, int]:
        return {"pushes": len(self.pushes), "pulls": sum(1 for *_, p in self._pulls if p.live),
                "inits": len(self.inits)}
