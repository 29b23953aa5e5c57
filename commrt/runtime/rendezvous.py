"""Who is who: every rank publishes a hello (addresses, protocol version, config digest) in
the bootstrap store and reads everyone else's. Duplicates, missing ranks and incompatible
builds are errors that say which ranks, never hangs."""
from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from urllib.parse import urlparse

import msgpack

from commrt.runtime.errors import ConfigError, RendezvousError
from commrt.runtime.store import wait_for
from commrt.runtime.store_core import ABORT, TIMEOUT
from commrt.transport.wire import VERSION

@dataclass(frozen=True)
class RendezvousSpec:
    """Where the bootstrap store lives, and who we are."""
    host: str
    port: int
    rank: int
    world_size: int
    use_agent_store: bool = False


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
        port = int(port_s)
    elif init_method.startswith("tcp://"):
        url = urlparse(init_method)
        if not url.hostname or not url.port:
            raise ConfigError(f"init_method {init_method!r} must look like tcp://host:port")
        host, port = url.hostname, url.port
    else:
        raise ConfigError(f"init_method {init_method!r} is invalid; valid: env:// or tcp://host:port")
    if world < 1 or not 0 <= rank_v < world:
        raise ConfigError(f"rank {rank_v} is invalid for world_size {world}")
    agent = environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    return RendezvousSpec(lookup(host, "the rendezvous address (MASTER_ADDR)"), port, rank_v, world, agent)


def lookup(host: str, what: str) -> str:
    """``host``'s IPv4 address, or a ``ConfigError`` saying which setting names an unknown host."""
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
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((master_host, 9))
            return s.getsockname()[0]
        except OSError as exc:
            raise ConfigError(f"bind_host {bind_host!r} needs advertise_host: no route to the "
                              f"rendezvous host {master_host} to pick an address from ({exc})") from None


def exchange(store, rank: int, world_size: int, info: dict, timeout_s: float,
             namespace: str = "") -> list[dict]:
    """Publish this rank's ``info``; return every rank's, index = rank."""
    ns = namespace + "rdzv/"
    hello = join(store, rank, world_size, info, timeout_s, ns)
    return gather(store, hello, world_size, timeout_s, ns)


def join(store, rank: int, world_size: int, info: dict, timeout_s: float, ns: str) -> dict:
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
    store.add(ns + "joined", 1)
    return hello


def gather(store, hello: dict, world_size: int, timeout_s: float, ns: str) -> list[dict]:
    """Wait (in the store: one parked request, no polling) until every rank joined, then read
    all hellos in one request and check them against ours."""
    abort_key = ns + "abort"
    status, value = store.wait_count(ns + "joined", world_size, abort_key, timeout_s)
    if status == ABORT:
        raise RendezvousError(bytes(value).decode(errors="replace"))
    keys = [f"{ns}hello/{r}/1" for r in range(world_size)]
    if status == TIMEOUT:
        missing = [r for r, v in enumerate(store.mget(keys)) if v is None]
        msg = (f"{len(missing)} of {world_size} ranks never joined within {timeout_s:g}s "
               f"(WORLD_SIZE {world_size}); missing: {rank_ranges(missing)}")
        store.set(abort_key, msg.encode())  # everyone who did join gets the same answer
        raise RendezvousError(msg)
    table = [msgpack.unpackb(v) for v in store.mget(keys)]
    for peer in table:
        _check_compatible(hello, peer)
    return table


def _who(h: dict) -> str:
    return f"{h.get('host')} pid {h.get('pid')} ({h.get('addr', '?')})"


def _check_compatible(mine: dict, theirs: dict) -> None:
    for key, what in (("version", "wire protocol version"), ("world_size", "world size"),
                      ("config", "config digest"), ("backend", "backend")):
        if mine.get(key) != theirs.get(key):
            raise RendezvousError(
                f"rank {theirs.get('rank')} ({_who(theirs)}) has {what} {theirs.get(key)!r}, "
                f"rank {mine['rank']} has {mine.get(key)!r}")


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
