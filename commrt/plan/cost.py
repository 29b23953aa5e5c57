"""Bytes one collective makes each rank send, inside its node and to other nodes: pure, and
following ``collectives/ops.py`` and ``collectives/hierarchical.py`` (not the textbook):

    all_reduce      the selection table's schedule (``Net.table``, ``[comm] algorithms``) replayed
                    step by step over the group (recursive doubling, Rabenseifner); the ring by its
                    formula, 2 (g-1)/g * S on average (each rank sends all chunks but its own, twice)
    all_gather      the same (Bruck replayed; the ring (g-1)/g * S; S: the gathered output)
    reduce_scatter  (g-1) * S/g either way (direct up to small_bytes, else the ring; not in the table)
    all_to_all      the part for each peer, to that peer

The world group spanning nodes (K nodes of M ranks, ``[comm] hierarchical``) runs all_reduce,
reduce_scatter and all_gather in two levels when each rank's part across nodes exceeds
small_bytes: intra reduce-scatter -> inter all_reduce of 1/M -> intra all_gather (the
all_reduce in up to ``segments_for`` pipelined pieces, each padded to a multiple of M).

Quantized collectives (``quant/collectives.py``, ``code(n)``: encoded bytes of n values, scales
per block and the 4-byte padding included) go flat over any group but the world spanning nodes,
which they cross in two hops (``quant/hierarchical.py``) whenever ``hierarchical`` says so for
their fp32 size, whatever the compute dtype ("auto": by the size alone, no probe): exact fp32
collectives inside the node and only the codes across nodes:

    all_gather      codes of the own part, all_gather over inter; fp32 all_gather of K x own over intra
    reduce_scatter  fp32 reduce_scatter of the K*M chunks over intra; the node sums' K chunks
                    encoded, all_to_all over inter
    all_reduce      fp32 reduce_scatter over intra (padded to M parts of P); the flat quantized
                    all_reduce of P over inter; fp32 all_gather of the M parts over intra

Every figure is the mean over the group's ranks, which is what every rank of a symmetric group
sends; ``Traffic.by_op`` names ops as ``comm_stats()["by_op"]`` does.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Callable

from commrt.collectives.algorithms import chunk_bounds
from commrt.collectives.schedules import ALGORITHMS
from commrt.collectives.selection import DEFAULT_TABLE, Rule, choose
from commrt.topology.dispatch import AUTO_PROBE_BYTES, HIERARCHY_HELPS, segments_for


@dataclass(frozen=True)
class Net:
    """The part of the cluster the formulas need."""
    nodes: int
    per_node: int
    small_bytes: int = 64 << 10
    chunk_bytes: int = 4 << 20
    hierarchical: str = "auto"
    intra_bw: float = 100e9
    inter_bw: float = 12.5e9
    table: tuple[Rule, ...] = DEFAULT_TABLE
    """Which schedule runs all_reduce and all_gather over TCP (selection.table_from)."""

    def seconds(self, intra: float, inter: float) -> float:
        """One flat step: its intra-node and cross-node links run at once; every rank of a
        node sends its cross-node bytes through the node's one link."""
        return max(intra / self.intra_bw, inter * self.per_node / self.inter_bw)

    @property
    def world(self) -> int:
        return self.nodes * self.per_node


@dataclass
class Traffic:
    """Bytes one rank sends, per wire op: {op: [intra, inter]}."""
    by_op: dict[str, list[float]] = field(default_factory=dict)

    def add(self, op: str, intra: float, inter: float) -> None:
        entry = self.by_op.setdefault(op, [0.0, 0.0])
        entry[0] += intra
        entry[1] += inter

    def merge(self, other: "Traffic", times: float = 1.0) -> None:
        for op, (a, b) in other.by_op.items():
            self.add(op, a * times, b * times)

    @property
    def intra(self) -> float:
        return sum(a for a, _ in self.by_op.values())

    @property
    def inter(self) -> float:
        return sum(b for _, b in self.by_op.values())


def group(start: int, size: int, stride: int = 1) -> tuple[int, ...]:
    return tuple(start + i * stride for i in range(size))


def _direct_split(ranks: tuple[int, ...], per_node: int) -> float:
    """Share of a direct exchange's bytes that stays inside nodes (mean over the members)."""
    g = len(ranks)
    same = sum(1 for a in ranks for b in ranks if a != b and a // per_node == b // per_node)
    return same / (g * (g - 1))


def _ring_split(ranks: tuple[int, ...], per_node: int) -> float:
    """Share of the ring's edges (rank -> right neighbour) that stay inside a node."""
    g = len(ranks)
    return sum(1 for i in range(g) if ranks[i] // per_node == ranks[(i + 1) % g] // per_node) / g


@functools.lru_cache(maxsize=1024)
def replayed(op: str, algorithm: str, ranks: tuple[int, ...], nbytes: int, per_node: int) -> tuple[float, float]:
    """Mean (intra, inter) bytes a rank of ``ranks`` sends running ``algorithm``'s schedule on a
    buffer of ``nbytes``, every step's send ranges summed over the schedule's chunks (in bytes:
    the runtime cuts elements, which moves a chunk's end by less than one element)."""
    g = len(ranks)
    build, parts = ALGORITHMS[op][algorithm]
    bounds = chunk_bounds(nbytes, parts(g, 1))
    starts = [a for a, _ in bounds]

    def upto(c: int) -> int:  # bytes of chunks [0, c), c taken past the end as Bruck's ranges wrap
        laps, c = divmod(c, len(bounds))
        return laps * nbytes + starts[c]
    sent = [0, 0]
    for r in range(g):
        for step in build(r, g, 0, 1):
            if step.send_to is not None and step.send[1] > step.send[0]:
                across = ranks[r] // per_node != ranks[step.send_to] // per_node
                sent[across] += upto(step.send[1]) - upto(step.send[0])
    return sent[0] / g, sent[1] / g


def _table_split(op: str, ranks: tuple[int, ...], nbytes: float, net: Net) -> tuple[float, float]:
    """all_reduce / all_gather: (intra, inter) bytes of the schedule the table picks (ops.py)."""
    g = len(ranks)
    algorithm = choose(op, int(nbytes), g, net.table)
    if algorithm != "ring":
        return replayed(op, algorithm, ranks, int(nbytes), net.per_node)
    # the ring, in O(g) where replaying its steps is O(g^2): rank i sends its right neighbour every
    # chunk but chunk i (the reduce-scatter) and every chunk but chunk i+1 (the all-gather)
    size = [b - a for a, b in chunk_bounds(int(nbytes), g)]
    sent = [0, 0]
    for i in range(g):
        right = (i + 1) % g
        mine = int(nbytes) - size[right] + (int(nbytes) - size[i] if op == "all_reduce" else 0)
        sent[ranks[i] // net.per_node != ranks[right] // net.per_node] += mine
    return sent[0] / g, sent[1] / g


def flat(t: Traffic, op: str, ranks: tuple[int, ...], nbytes: float, net: Net) -> float:
    """One flat collective of ``op`` over ``ranks``: ``nbytes`` is the buffer (all_reduce), the
    input (reduce_scatter), the output (all_gather), or what one rank sends in all (all_to_all)."""
    g = len(ranks)
    if g < 2 or nbytes <= 0:
        return 0.0
    if op in ("all_reduce", "all_gather"):
        intra, inter = _table_split(op, ranks, nbytes, net)
    else:
        sent = nbytes if op == "all_to_all" else (g - 1) / g * nbytes
        direct = op == "all_to_all" or nbytes <= net.small_bytes
        share = _direct_split(ranks, net.per_node) if direct else _ring_split(ranks, net.per_node)
        intra, inter = sent * share, sent * (1 - share)
    t.add(op, intra, inter)
    return net.seconds(intra, inter)


def hierarchical(net: Net, is_world: bool, nbytes: float, quantized: bool = False) -> bool:
    """Whether ``dispatch.wants_hierarchical`` sends this op through two levels; "auto" as the
    runtime's probe would decide on a cluster with these bandwidths (``auto_helps``), or, for a
    quantized op, by the size alone (no probe)."""
    if not is_world or net.hierarchical == "never" or net.nodes < 2 or net.per_node < 2:
        return False
    return net.hierarchical == "always" or (nbytes // net.per_node > net.small_bytes
                                            and (quantized or auto_helps(net)))


def auto_helps(net: Net) -> bool:
    """The runtime's "auto" probe, predicted: a world all_reduce of AUTO_PROBE_BYTES, two levels
    at least HIERARCHY_HELPS times faster than flat."""
    ranks, numel = group(0, net.world), AUTO_PROBE_BYTES // 4
    flat_s = collective(Traffic(), "all_reduce", ranks, numel, 4, dataclasses.replace(net, hierarchical="never"))
    two_s = collective(Traffic(), "all_reduce", ranks, numel, 4, dataclasses.replace(net, hierarchical="always"))
    return two_s * HIERARCHY_HELPS <= flat_s


def collective(t: Traffic, op: str, ranks: tuple[int, ...], numel: int, itemsize: int, net: Net) -> float:
    """``op`` on ``numel`` elements (the whole buffer / input / output) over ``ranks``, flat or
    in two levels as the runtime would choose; returns its predicted seconds (levels in turn)."""
    is_world = len(ranks) == net.world
    if not hierarchical(net, is_world, numel * itemsize):
        return flat(t, op, ranks, numel * itemsize, net)
    m, k = net.per_node, net.nodes
    intra, inter = group(0, m), group(0, k, m)
    if op == "reduce_scatter":
        return flat(t, op, intra, numel * itemsize, net) + flat(t, op, inter, numel // m * itemsize, net)
    if op == "all_gather":
        return flat(t, op, inter, numel // m * itemsize, net) + flat(t, op, intra, numel * itemsize, net)
    segs = segments_for(numel * itemsize, net.chunk_bytes)
    per = -(-numel // max(1, segs) // m) * m
    seconds = 0.0
    for a in range(0, numel, per):
        part = -(-min(per, numel - a) // m)
        seconds += (flat(t, "reduce_scatter", intra, part * m * itemsize, net)
                    + flat(t, "all_reduce", inter, part * itemsize, net)
                    + flat(t, "all_gather", intra, part * m * itemsize, net))
    return seconds


def _two_hop(net: Net, ranks: tuple[int, ...], numel: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(intra, inter) when ``quant.hierarchical.levels`` takes the two hops for ``numel`` fp32 values."""
    if not hierarchical(net, len(ranks) == net.world, numel * 4, quantized=True):
        return None
    return group(0, net.per_node), group(0, net.nodes, net.per_node)


def q_all_gather(t: Traffic, ranks: tuple[int, ...], own: int, code: Callable[[int], int], net: Net) -> float:
    """Quantized all_gather of ``own`` values per rank (the gather hop: one all_gather of codes)."""
    lv = _two_hop(net, ranks, len(ranks) * own)
    if lv is None:
        return flat(t, "all_gather", ranks, len(ranks) * code(own), net)
    intra, inter = lv
    return flat(t, "all_gather", inter, len(inter) * code(own), net) + \
        flat(t, "all_gather", intra, len(intra) * len(inter) * own * 4, net)


def q_reduce_scatter(t: Traffic, ranks: tuple[int, ...], out: int, code: Callable[[int], int], net: Net) -> float:
    """Quantized reduce_scatter to ``out`` values per rank (the reduce hop: each chunk for a
    peer encoded, one all_to_all; the own chunk stays)."""
    lv = _two_hop(net, ranks, len(ranks) * out)
    if lv is None:
        return flat(t, "all_to_all", ranks, (len(ranks) - 1) * code(out), net)
    intra, inter = lv
    return flat(t, "reduce_scatter", intra, len(ranks) * out * 4, net) + \
        flat(t, "all_to_all", inter, (len(inter) - 1) * code(out), net)


def q_all_reduce(t: Traffic, ranks: tuple[int, ...], numel: int, code: Callable[[int], int], net: Net) -> float:
    """Quantized all_reduce: the reduce hop on ``chunk_bounds``, then the gather hop of the
    reduced chunks, each padded to the largest; two-hop around the inter-node part."""
    lv = _two_hop(net, ranks, numel)
    if lv is None:
        return _q_all_reduce_flat(t, ranks, numel, code, net)
    intra, inter = lv
    part = -(-numel // len(intra))  # the tail pads the last local rank's part
    return (flat(t, "reduce_scatter", intra, part * len(intra) * 4, net)
            + _q_all_reduce_flat(t, inter, part, code, net)
            + flat(t, "all_gather", intra, part * len(intra) * 4, net))


def _q_all_reduce_flat(t: Traffic, ranks: tuple[int, ...], numel: int, code: Callable[[int], int], net: Net) -> float:
    g = len(ranks)
    sizes = [code(b - a) for a, b in chunk_bounds(numel, g)]
    return flat(t, "all_to_all", ranks, sum(sizes) * (g - 1) / g, net) + flat(t, "all_gather", ranks, g * max(sizes), net)
