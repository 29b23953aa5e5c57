"""``commrt.comm_stats()``: what this rank has sent since init, split by where it went.

The transport counts bytes per peer and per (message kind, op); the topology says which peers
share this rank's node. Other layers add their own keys with ``register`` (e.g. the quantized
collectives' savings), so one call shows everything. ``resources`` is what the rank costs the
host (issue 32.2): memory, open files and threads, read from /proc when asked.
"""
from __future__ import annotations

import os
from typing import Any, Callable

from commrt.runtime import world
from commrt.collectives.context import _NAMES
from commrt.transport.wire import P2P

_SECTIONS: dict[str, Callable[[], Any]] = {}


def register(key: str, fn: Callable[[], Any]) -> None:
    """Make ``comm_stats()[key]`` the value of ``fn()`` (called at each comm_stats())."""
    if key in ("intra_node_bytes", "inter_node_bytes", "by_op", "resources", "rendezvous"):
        raise ValueError(f"comm_stats key {key!r} is built in")
    _SECTIONS[key] = fn


def _peer_rank(name: str) -> int | None:
    return int(name[4:]) if name.startswith("rank") and name[4:].isdecimal() else None


def split_by_node(sent: dict[tuple, int], same_node: list[bool], msgs: dict[tuple, int] | None = None) -> dict:
    """Pure: ``{(kind, op, peer name): bytes}`` -> totals and per-op intra/inter bytes; with
    ``msgs`` (the same keys, message counts) each op also gets ``messages``."""
    total = {"intra_node_bytes": 0, "inter_node_bytes": 0, "by_op": {}}
    for (kind, op, peer), nbytes in sent.items():
        r = _peer_rank(peer)
        if r is None or r >= len(same_node):
            continue
        where = "intra_node_bytes" if same_node[r] else "inter_node_bytes"
        name = "p2p" if kind == P2P else _NAMES.get(op, f"op{op}")
        entry = total["by_op"].setdefault(name, {"intra_node_bytes": 0, "inter_node_bytes": 0})
        entry[where] += nbytes
        total[where] += nbytes
        if msgs is not None:
            entry["messages"] = entry.get("messages", 0) + msgs.get((kind, op, peer), 0)
    return total


def resources() -> dict:
    """This process's RSS and its peak (VmRSS, VmHWM, in KiB), open file descriptors and
    threads, from /proc/self (Linux); fields /proc does not give are left out."""
    out: dict = {}
    try:
        with open("/proc/self/status") as fh:
            fields = dict(line.split(":", 1) for line in fh if ":" in line)
        out.update(rss_kib=int(fields["VmRSS"].split()[0]), peak_rss_kib=int(fields["VmHWM"].split()[0]),
                   threads=int(fields["Threads"]))
        out["open_files"] = len(os.listdir("/proc/self/fd")) - 1  # less the listing's own descriptor
    except (OSError, KeyError, ValueError):  # not Linux, or a kernel without these fields
        pass
    return out


def store_stats(rt) -> dict:
    """How this rank reaches the bootstrap store (issue 32.5): ``store_via_proxy`` (through its
    node's proxy, store_proxy.py); ``store_connections`` (rank 0: connections its store has
    served); ``proxy_clients`` (a node's leader: its node's ranks served by its proxy)."""
    server, proxy = rt.store_server, rt.store_proxy
    return {"store_via_proxy": bool(getattr(rt.store, "via", "")),
            "store_connections": server.connections if server is not None else None,
            "proxy_clients": proxy.stats()["clients"] if proxy is not None else None}


def comm_stats() -> dict:
    """``intra_node_bytes`` / ``inter_node_bytes``: bytes this rank's collectives and
    point-to-point transfers sent to ranks on its own node / on other nodes, since init;
    ``by_op``: the same per op kind as it went on the wire (a hierarchical all_reduce shows as
    its reduce_scatter, all_reduce and all_gather steps), each with ``messages``: how many
    messages it sent (a message is one header and its payload piece); ``resources``: this rank's
    RSS, peak RSS (KiB), open files and threads now; ``rendezvous``: the peers' hellos this rank
    read from the bootstrap store (``hellos_read``, ``hello_bytes``; ``lazy``: read per peer
    when first dialled), the zmq groups' addresses it read and published
    (``group_addresses_read``, ``group_address_bytes``, ``group_addresses_published``) and how
    it reaches the store (``store_stats``); plus every registered key."""
    rt = world.current()
    counters = rt.transport.counters
    same = counters.same_node or [True] * rt.world.size()
    out = split_by_node(counters.sent_by_op(), same, counters.sent_by_op(messages=True))
    out["resources"] = resources()
    # hellos this rank read from the bootstrap store (issue 32.5): gloo/nccl read every rank's
    out["rendezvous"] = {**(rt.hellos.stats() if rt.hellos is not None else
                            {"lazy": False, "hellos_read": rt.world.size(), "hello_bytes": None}),
                         **rt.group_reads.stats(),  # zmq groups' addresses (runtime/groups.py)
                         **store_stats(rt)}
    for key, fn in _SECTIONS.items():
        out[key] = fn()
    return out
