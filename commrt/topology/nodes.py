"""Which rank runs on which node (pure: no sockets, no runtime).

Two sources, in order of trust:

- torchrun's variables, which ``commrt launch`` sets too: GROUP_RANK (the node), LOCAL_RANK and
  LOCAL_WORLD_SIZE. Every rank sends its own in its hello, so a layout that disagrees between
  ranks is caught here rather than by a wrong hierarchical result later.
- otherwise, the hellos' host identity (host name plus the address peers dial): ranks that share
  both share a node. Network namespaces on one machine share a host name but not an address,
  so each emulated node counts as one.

Ranks of one node must be contiguous (``rank = node * per_node + local_rank``), as torchrun makes
them: the hierarchical collectives and the device mesh cut the world into such blocks.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Mapping

from commrt.runtime.errors import RendezvousError

ENV_VARS = ("GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@dataclass(frozen=True)
class Topology:
    node_of: tuple[int, ...]
    """Node index of each global rank (nodes numbered 0.. in rank order)."""
    source: str = "hosts"
    """Where the layout came from: ``env`` (torchrun variables) or ``hosts`` (the hellos)."""

    @property
    def world_size(self) -> int:
        return len(self.node_of)

    @functools.cached_property  # read on every collective's way in (dispatch.route)
    def num_nodes(self) -> int:
        return self.node_of[-1] + 1 if self.node_of else 0

    def node_rank(self, rank: int) -> int:
        return self.node_of[rank]

    def ranks_on(self, node: int) -> list[int]:
        return [r for r, n in enumerate(self.node_of) if n == node]

    def local_rank(self, rank: int) -> int:
        return rank - self.node_of.index(self.node_of[rank])

    def local_world_size(self, rank: int) -> int:
        return self.node_of.count(self.node_of[rank])

    def per_node(self) -> int:
        """Ranks per node when every node has the same number, else 0."""
        sizes = {self.node_of.count(n) for n in range(self.num_nodes)}
        return sizes.pop() if len(sizes) == 1 else 0

    def same_node(self, a: int, b: int) -> bool:
        return self.node_of[a] == self.node_of[b]


def node_hint(environ: Mapping[str, str]) -> list[int] | None:
    """``[GROUP_RANK, LOCAL_RANK, LOCAL_WORLD_SIZE]`` from the environment, or None when any is
    absent (then the hellos' hosts decide). Malformed values are a ``RendezvousError``."""
    if not all(v in environ for v in ENV_VARS):
        return None
    try:
        return [int(environ[v]) for v in ENV_VARS]
    except ValueError:
        raise RendezvousError("node layout: " + ", ".join(f"{v}={environ[v]!r}" for v in ENV_VARS)
                              + " must all be integers") from None


def from_hellos(hellos: list[dict]) -> Topology:
    """The layout from every rank's hello (index = rank): their ``node`` hints when every rank
    has one, else their host identity (``host`` and ``where``)."""
    hints = [h.get("node") for h in hellos]
    if hints and all(h is not None for h in hints):
        return from_hints([tuple(h) for h in hints])
    return from_keys([(h.get("host"), h.get("where")) for h in hellos])


def from_keys(keys: list) -> Topology:
    """Ranks with equal keys share a node; nodes are numbered in order of first appearance."""
    index: dict = {}
    node_of = []
    for rank, key in enumerate(keys):
        if key in index and node_of[-1] != index[key]:
            earlier = [r for r, n in enumerate(node_of) if n == index[key]]
            raise RendezvousError(
                f"ranks of one node must be contiguous (as torchrun numbers them): rank {rank} shares "
                f"{_name(key)} with rank(s) {earlier}, but rank {rank - 1} between them is on another node")
        node_of.append(index.setdefault(key, len(index)))
    return Topology(tuple(node_of), "hosts")


def from_hints(hints: list[tuple[int, int, int]]) -> Topology:
    """Check that ``(GROUP_RANK, LOCAL_RANK, LOCAL_WORLD_SIZE)`` of every rank describe contiguous
    nodes numbered in rank order: rank = first rank of its node + LOCAL_RANK."""
    node_of: list[int] = []
    first, node = 0, 0
    while first < len(hints):
        size = max(1, hints[first][2])
        for local in range(size):
            rank = first + local
            if rank >= len(hints):
                raise RendezvousError(f"node {node} (GROUP_RANK={node}) has {len(hints) - first} ranks "
                                      f"but LOCAL_WORLD_SIZE={size}")
            if tuple(hints[rank]) != (node, local, size):
                group, got_local, got_size = hints[rank]
                raise RendezvousError(
                    f"rank {rank} says GROUP_RANK={group} LOCAL_RANK={got_local} LOCAL_WORLD_SIZE={got_size}, "
                    f"but ranks of one node must be contiguous (rank = node's first rank + LOCAL_RANK, "
                    f"as torchrun numbers them): expected GROUP_RANK={node} LOCAL_RANK={local} "
                    f"LOCAL_WORLD_SIZE={size}")
            node_of.append(node)
        first, node = first + size, node + 1
    return Topology(tuple(node_of), "env")


def node_sizes(t: Topology) -> list[list[int]]:
    """``t`` as runs of equal node sizes, ``[[ranks per node, nodes], ...]``: the compact layout
    rank 0 publishes (one pair for a uniform job at any size), so no other rank reads every hello."""
    sizes = [0] * t.num_nodes
    for node in t.node_of:
        sizes[node] += 1
    runs: list[list[int]] = []
    for size in sizes:
        if runs and runs[-1][0] == size:
            runs[-1][1] += 1
        else:
            runs.append([size, 1])
    return runs


def from_sizes(runs, source: str = "env") -> Topology:
    """The inverse of ``node_sizes``; a malformed record is a ``RendezvousError``."""
    node_of: list[int] = []
    try:
        for size, count in runs:
            if size < 1 or count < 1:
                raise ValueError
            for _ in range(count):
                node_of.extend([node_of[-1] + 1 if node_of else 0] * size)
    except (TypeError, ValueError):
        raise RendezvousError(f"malformed node layout record {runs!r}") from None
    return Topology(tuple(node_of), source)


def _name(key) -> str:
    host, where = key if isinstance(key, tuple) and len(key) == 2 else (key, None)
    return f"{host} ({where})" if where else str(host)
