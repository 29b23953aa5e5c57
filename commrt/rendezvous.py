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

from .errors import ConfigError, RendezvousError
from .store import Store, wait_for
from .wire import VERSION

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
    return RendezvousSpec(socket.gethostbyname(host), port, rank_v, world, agent)


def exchange(store: Store, rank: int, world_size: int, info: dict, timeout_s: float,
             namespace: str = "") -> list[dict]:
    """Publish this rank's ``info``; return every rank's, index = rank."""
    ns = namespace + "rdzv/"
    abort_key = ns + "abort"
    hello = {**info, "rank": rank, "world_size": world_size, "version": VERSION,
             "host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}
    claim = store.add(f"{ns}claim/{rank}", 1)
    store.set(f"{ns}hello/{rank}/{claim}", msgpack.packb(hello))
    if claim > 1:
        first = msgpack.unpackb(wait_for(store, [f"{ns}hello/{rank}/1"], timeout_s, "rendezvous")[0])
        msg = (f"duplicate rank {rank}: already taken by {_who(first)}; "
               f"refused {_who(hello)}")
        store.set(abort_key, msg.encode())
        raise RendezvousError(msg)
    keys = [f"{ns}hello/{r}/1" for r in range(world_size)]
    try:
        raw = wait_for(store, keys, timeout_s, "rendezvous", abort_key=abort_key)
    except RendezvousError as exc:
        if "still missing" not in str(exc):
            raise
        values = store.mget(keys)
        missing = [r for r, v in enumerate(values) if v is None]
        msg = f"ranks {missing} never joined within {timeout_s:g}s (world_size {world_size})"
        store.set(abort_key, msg.encode())  # everyone who did join gets the same answer
        raise RendezvousError(msg) from None
    table = [msgpack.unpackb(v) for v in raw]
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
