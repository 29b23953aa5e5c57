"""Who is who: every rank publishes a hello (addresses, protocol version, config digest) in
the bootstrap store. Duplicates, missing ranks and incompatible builds are errors that say
which ranks, never hangs.

Two ways to end it. ``exchange``: every rank reads every hello (n per rank, n^2 served by rank
0's store; gloo/nccl, and the zmq backend NCCL falls back to). ``meet`` (issue 32.5; every zmq
world): each rank checks its hello against rank 0's before it counts as joined (equality is
transitive, so the job agrees when all agree with rank 0); rank 0 alone reads every hello, checks
the layout and publishes it compactly (runs of node sizes); the others read a peer's hello only
when they first dial it (``Hellos``), so a rank reads O(its peers) hellos, not n. Without
torchrun's node variables, or on shared memory, rank 0 has every rank read every hello instead."""
from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

import msgpack

from commrt.runtime import addresses
from commrt.runtime.errors import CommError, ConfigError, RendezvousError
from commrt.runtime.store import wait_for
from commrt.runtime.store_core import ABORT, TIMEOUT
from commrt.topology import nodes
from commrt.transport.wire import VERSION

@dataclass(frozen=True)
class RendezvousSpec:
    """Where the bootstrap store lives, and who we are."""
    host: str
    port: int
    rank: int
    world_size: int
    use_agent_store: bool = False
    attempt: int = 0
    """torchrun's restart count (TORCHELASTIC_RESTART_COUNT): its agent's store outlives a start."""


def resolve(init_method: str | None, rank: int | None, world_size: int | None,
            environ=os.environ) -> RendezvousSpec:
    """Interpret ``env://`` (torchrun variables) or ``tcp://host:port``."""
    init_method = init_method or "env://"

    def need(name: str, given):
        if given is not None and given >= 0:
            return int(given)
        if name not in environ:
            raise ConfigError(f"{name} is not set and was not passed to init_process_group "
                              f"(init_method={init_method})")
        try:
            return int(environ[name])
        except ValueError:
            raise ConfigError(f"{name}={environ[name]!r} is not an integer") from None

    rank_v = need("RANK", rank)
    world = need("WORLD_SIZE", world_size if world_size else None)
    if init_method == "env://":
        host = environ.get("MASTER_ADDR")
        port_s = environ.get("MASTER_PORT")
        if not host or not port_s:
            raise ConfigError("env:// needs MASTER_ADDR and MASTER_PORT")
        port = _port(port_s, f"MASTER_PORT={port_s!r}")
    elif init_method.startswith("tcp://"):
        url = urlparse(init_method)
        try:  # urllib raises ValueError for a port that is not a number or beyond 65535
            host, port = url.hostname, url.port
        except ValueError:
            host = port = None
        if not host or not port:
            raise ConfigError(f"init_method {init_method!r} must look like tcp://host:port (port 1-65535)")
    else:
        raise ConfigError(f"init_method {init_method!r} is invalid; valid: env:// or tcp://host:port")
    if world < 1 or not 0 <= rank_v < world:
        raise ConfigError(f"rank {rank_v} is invalid for world_size {world}")
    agent = environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    attempt = environ.get("TORCHELASTIC_RESTART_COUNT", "0") if agent else "0"
    if not attempt.isdigit():
        raise ConfigError(f"TORCHELASTIC_RESTART_COUNT={attempt!r} is not a non-negative integer")
    return RendezvousSpec(lookup(host, "the rendezvous address (MASTER_ADDR)"), port, rank_v, world, agent,
                          int(attempt))


def _port(text: str, what: str) -> int:
    """A TCP port 1-65535 from a variable's text, or a ConfigError naming the variable."""
    try:
        port = int(text)
    except ValueError:
        port = 0
    if not 0 < port <= 65535:
        raise ConfigError(f"{what} is invalid; expected a port number 1-65535")
    return port


def lookup(host: str, what: str) -> str:
    """``host``'s IPv4 address (an IPv6 literal stays itself, without brackets), or a
    ``ConfigError`` saying which setting names an unknown host."""
    ip = addresses.literal(host)
    if ip is not None:
        return ip
    try:
        return socket.gethostbyname(host)
    except OSError as exc:
        raise ConfigError(f"{what} {host!r} cannot be resolved: {exc}") from None


WILDCARDS = ("0.0.0.0", "*", "", "::")


def advertised_host(bind_host: str, advertise_host: str, master_host: str) -> str:
    """The address peers should dial to reach sockets bound to ``bind_host``. An explicit
    ``advertise_host`` wins; a wildcard bind is advertised as the local address of the interface
    that routes to the rendezvous host (a UDP connect() chooses the route; no packet is sent),
    since ``0.0.0.0`` would make every peer dial itself."""
    if advertise_host:
        return advertise_host
    if bind_host not in WILDCARDS:
        return bind_host
    with socket.socket(addresses.family(master_host), socket.SOCK_DGRAM) as s:
        try:
            s.connect((addresses.bare(master_host), 9))
            return s.getsockname()[0]
        except OSError as exc:
            raise ConfigError(f"bind_host {bind_host!r} needs advertise_host: no route to the "
                              f"rendezvous host {master_host} to pick an address from ({exc})") from None


def exchange(store, rank: int, world_size: int, info: dict, timeout_s: float,
             namespace: str = "") -> list[dict]:
    """Publish this rank's ``info``; return every rank's, index = rank. As in ``meet``, a rank
    checks itself against rank 0's hello before it counts as joined, and rank 0 seals the world
    (``_seal``) before any rank returns: a stray rank told a larger WORLD_SIZE fails every rank."""
    ns = namespace + "rdzv/"
    end = time.monotonic() + timeout_s  # one deadline for the waits below
    left = lambda: max(0.001, end - time.monotonic())  # noqa: E731
    hello = _claim(store, rank, world_size, info, left(), ns)
    if rank != 0:
        _agree_with_first(store, hello, left(), ns)
    store.add(ns + "joined", 1)
    table = gather(store, hello, world_size, left(), ns)
    if rank == 0:
        _seal(store, hello, world_size, ns)
        store.set(ns + "sealed", b"1")
    else:
        wait_for(store, [ns + "sealed"], left(), "rendezvous (rank 0's verdict)", ns + "abort")
    return table


def join(store, rank: int, world_size: int, info: dict, timeout_s: float, ns: str) -> dict:
    """Claim ``rank`` and publish its hello, then count as joined."""
    hello = _claim(store, rank, world_size, info, timeout_s, ns)
    store.add(ns + "joined", 1)
    return hello


def _claim(store, rank: int, world_size: int, info: dict, timeout_s: float, ns: str) -> dict:
    """Claim ``rank`` and publish its hello (a duplicate claim aborts the whole rendezvous)."""
    hello = {**info, "rank": rank, "world_size": world_size, "version": VERSION,
             "host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}
    claim = store.add(f"{ns}claim/{rank}", 1)
    store.set(f"{ns}hello/{rank}/{claim}", msgpack.packb(hello))
    if claim > 1:
        first = msgpack.unpackb(wait_for(store, [f"{ns}hello/{rank}/1"], timeout_s, "rendezvous")[0])
        msg = f"duplicate rank {rank}: already taken by {_who(first)}; refused {_who(hello)}"
        store.set(ns + "abort", msg.encode())
        raise RendezvousError(msg)
    return hello


def _agree_with_first(store, hello: dict, timeout_s: float, ns: str) -> bytes:
    """Rank 0's hello (packed), once ``hello`` is found compatible with it; otherwise the
    rendezvous is aborted for every rank with the message rank 0 would have written (joined
    never reaches the world size: every waiter gets the abort)."""
    raw = wait_for(store, [f"{ns}hello/0/1"], timeout_s, "rendezvous (rank 0's hello)", ns + "abort")[0]
    problem = _incompatibility(msgpack.unpackb(raw), hello)
    if problem:
        store.set(ns + "abort", problem.encode())
        raise RendezvousError(problem)
    return raw


def gather(store, hello: dict, world_size: int, timeout_s: float, ns: str) -> list[dict]:
    """Wait (in the store: one parked request, no polling) until every rank joined, then read
    all hellos in one request and check them against ours. A mismatch aborts the rendezvous for
    every rank, as in ``meet``: a rank told a larger WORLD_SIZE would otherwise wait out its
    timeout and blame a rank that does not exist. The hellos are waited for, not just read: the
    joined counter counts any rank, and a stray one of a larger world may fill it before one of
    ours has published (its hello then read as None: a TypeError, not a rendezvous)."""
    end = time.monotonic() + timeout_s
    _all_joined(store, world_size, timeout_s, ns)
    raw = wait_for(store, hello_keys(ns, range(world_size)), max(0.001, end - time.monotonic()),
                   "rendezvous (the hellos of every rank that joined)", ns + "abort")
    table = [msgpack.unpackb(v) for v in raw]
    for peer in table:
        problem = _incompatibility(hello, peer)
        if problem:
            store.set(ns + "abort", problem.encode())
            raise RendezvousError(problem)
    return table


@dataclass
class Met:
    """What ``meet`` gives a rank: its hello, the compact layout (``nodes``: runs of ``[ranks per
    node, nodes]``; None where rank 0 found that every rank needs every hello) and the hellos it
    read (``table``: all of them on rank 0, and on every rank when ``nodes`` is None)."""
    hello: dict
    nodes: list | None
    table: list[dict] | None
    read: list[int] = field(default_factory=lambda: [0, 0])
    """Hellos this rank read so far, and their bytes."""
    known: dict = field(default_factory=dict)
    """Other hellos read on the way, by rank (rank 0's, which every rank checks against)."""


def meet(store, rank: int, world_size: int, info: dict, timeout_s: float, namespace: str = "",
         needs_all=lambda table: False) -> Met:
    """The rendezvous that does not read every hello on every rank (see the module's doc).
    ``needs_all(table)``, asked on rank 0: whether every rank needs every hello anyway (e.g. a
    shared-memory world connects to every rank at init); so are ranks without node hints."""
    ns = namespace + "rdzv/"
    end = time.monotonic() + timeout_s  # one deadline for the waits below: each with a whole
    left = lambda: max(0.001, end - time.monotonic())  # noqa: E731 - timeout_s let init take 2-3x it
    hello = _claim(store, rank, world_size, info, left(), ns)
    first = _agree_with_first(store, hello, left(), ns) if rank != 0 else None
    store.add(ns + "joined", 1)
    _all_joined(store, world_size, left(), ns, timeout_s)
    table = None
    if rank == 0:
        raw = store.mget(hello_keys(ns, range(world_size)))
        table = [msgpack.unpackb(v) for v in raw]
        record = _layout_record(store, table, needs_all, ns)
        _seal(store, hello, world_size, ns)
        store.set(ns + "layout", msgpack.packb(record))
    else:
        raw = [first]
        record = msgpack.unpackb(wait_for(store, [ns + "layout"], left(), "rendezvous (rank 0's layout)",
                                          ns + "abort")[0])
        if record.get("full"):
            every = store.mget(hello_keys(ns, range(world_size)))
            table = [msgpack.unpackb(v) for v in every]
            raw += every
    met = Met(hello, record.get("nodes"), table, known={0: msgpack.unpackb(first)} if first else {})
    met.read[:] = [len(raw), sum(len(v) for v in raw)]
    return met


def _layout_record(store, table: list[dict], needs_all, ns: str) -> dict:
    """Rank 0: the layout every rank gets, or the reason every rank fails (via the abort key)."""
    try:
        layout = nodes.from_hellos(table)
    except RendezvousError as exc:
        store.set(ns + "abort", str(exc).encode())
        raise
    if layout.source != "env" or needs_all(table):
        return {"full": 1}  # host identities need every hello to tell nodes apart
    return {"nodes": nodes.node_sizes(layout)}


def _seal(store, first: dict, world_size: int, ns: str) -> None:
    """Rank 0, once every rank of its world joined: fail everyone if a rank of a larger world
    is in sight (its hello, or the abort it wrote on finding rank 0's world size unlike its own).
    Ranks 0 and 1 told WORLD_SIZE 2 and a rank 2 told 3 otherwise formed a world of 2 while rank
    2 alone failed. Rank 0 alone decides and the others wait for its verdict, so the world's
    ranks agree; a stray that comes later still fails itself, against rank 0's hello."""
    stray, abort = store.mget([f"{ns}hello/{world_size}/1", ns + "abort"])
    if abort is not None:
        raise RendezvousError(bytes(abort).decode(errors="replace"))
    if stray is not None:
        problem = _incompatibility(first, msgpack.unpackb(stray)) or (
            f"rank {world_size} joined a world of {world_size} ranks (WORLD_SIZE {world_size})")
        store.set(ns + "abort", problem.encode())
        raise RendezvousError(problem)


class Hellos:
    """Peers' hellos, read from the store when first needed (``get``), in one request per call.
    Thread-safe: the collective and point-to-point endpoints resolve from their own threads.
    ``store_rank``: the rank serving the store (0), or None (torchrun's agent serves it);
    ``proxy_rank``: the rank whose store proxy this rank goes through (store_proxy.py), if any."""

    def __init__(self, store, rank: int, world_size: int, namespace: str, timeout_s: float,
                 met: Met, store_rank: int | None = 0, proxy_rank: int | None = None):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.ns, self.timeout_s, self.store_rank = namespace + "rdzv/", timeout_s, store_rank
        self._cut_off_by = {r for r in (store_rank, proxy_rank) if r is not None}
        self.lazy = met.nodes is not None
        self._known: dict[int, dict] = {**met.known, **dict(enumerate(met.table or ()))}
        self._known[rank] = met.hello
        self._read = list(met.read)
        self._lock = threading.Lock()

    def stats(self) -> dict:
        """For comm_stats: whether hellos are read per peer, how many this rank read, their bytes."""
        return {"lazy": self.lazy, "hellos_read": self._read[0], "hello_bytes": self._read[1]}

    def get(self, peers, op: str, lost: int | None = None) -> dict[int, dict]:
        """The hellos of ``peers``, reading the unknown ones in one request within ``timeout_s``.
        ``lost``: a rank known dead; if it serves the store or this rank's proxy of it, only
        known hellos come back (a best-effort caller must not wait out the deadline on a dead
        store)."""
        with self._lock:
            missing = [p for p in peers if p not in self._known]
            if missing and lost not in self._cut_off_by:
                self._fetch(missing, op)
            return {p: self._known[p] for p in peers if p in self._known}

    def _fetch(self, missing: list[int], op: str) -> None:
        bad = [p for p in missing if not 0 <= p < self.world_size]
        if bad:
            raise RendezvousError(f"rank {self.rank}: no peer rank {bad[0]} in a world of {self.world_size} ({op})")
        try:
            raw = wait_for(self.store, hello_keys(self.ns, missing), self.timeout_s, "its hello")
        except CommError as exc:
            raise RendezvousError(f"rank {self.rank}: cannot read the address of peer rank "
                                  f"{rank_ranges(missing)} for {op}: {exc}") from None
        for p, v in zip(missing, raw):
            self._known[p] = msgpack.unpackb(v)
        self._read[0] += len(raw)
        self._read[1] += sum(len(v) for v in raw)


ABORT_TOLD_S = 10.0  # how long the store's and proxies' hosts serve on after an abort (see below)


def abort_told(store, world_size: int, namespace: str, serves: bool) -> None:
    """After a failed rendezvous, best effort: if it was aborted, count this rank as told; a rank
    that serves the store or its node's proxy (``serves``) then keeps serving until every rank
    has been told, for ABORT_TOLD_S at most (a rank that is dead or never comes costs that much
    of the failing job's exit). Closing after a fixed 1 s failed a rank that was slow to ask
    under load (CI): it named the closed store or proxy, not the rendezvous's reason."""
    ns = namespace + "rdzv/"
    try:
        if store.mget([ns + "abort"])[0] is None:
            return  # not an abort: nobody else is waiting for this rendezvous's verdict
        store.add(ns + "told", 1, timeout_s=1.0)
        if serves:
            store.wait_count(ns + "told", world_size, None, ABORT_TOLD_S)
    except Exception:  # the store itself may be what failed
        pass


def hello_keys(ns: str, ranks) -> list[str]:
    return [f"{ns}hello/{r}/1" for r in ranks]


def _all_joined(store, world_size: int, timeout_s: float, ns: str, total_s: float | None = None) -> None:
    """Wait (one parked request) until every rank joined; an abort or the deadline is a
    ``RendezvousError``, the deadline's naming the missing ranks (and told to all who joined).
    ``total_s``: the whole rendezvous's timeout, which the message names (default timeout_s)."""
    abort_key = ns + "abort"
    status, value = store.wait_count(ns + "joined", world_size, abort_key, timeout_s)
    if status == ABORT:
        raise RendezvousError(bytes(value).decode(errors="replace"))
    if status == TIMEOUT:
        missing = [r for r, v in enumerate(store.mget(hello_keys(ns, range(world_size)))) if v is None]
        msg = (f"{len(missing)} of {world_size} ranks never joined within {total_s or timeout_s:g}s "
               f"(WORLD_SIZE {world_size}); missing: {rank_ranges(missing)}")
        store.set(abort_key, msg.encode())  # everyone who did join gets the same answer
        raise RendezvousError(msg)


def _who(h: dict) -> str:
    return f"{h.get('host')} pid {h.get('pid')} ({h.get('addr', '?')})"


def _incompatibility(mine: dict, theirs: dict) -> str:
    """What makes ``theirs`` unable to work with ``mine``, naming both ranks ('' if nothing)."""
    for key, what in (("version", "wire protocol version"), ("world_size", "world size"),
                      ("config", "config digest"), ("backend", "backend")):
        if mine.get(key) != theirs.get(key):
            return (f"rank {theirs.get('rank')} ({_who(theirs)}) has {what} {theirs.get(key)!r}, "
                    f"rank {mine['rank']} has {mine.get(key)!r}")
    return ""


def rank_ranges(ranks: list[int]) -> str:
    """``[2, 3, 4, 7]`` -> ``'2-4, 7'``: a missing-ranks list that stays readable at any size."""
    parts, ranks = [], sorted(ranks)
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ", ".join(parts)
