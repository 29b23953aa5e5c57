"""The network ``plan.simulate`` replays schedules over (issue 32.4): pure data, no I/O.

Nodes of ``per_node`` ranks (rank r on node r // per_node). Inside a node every rank has a
port into the node's fabric, one link each way (``intra_bw``; NVLink or shared memory). Each
node has one NIC, a link each way to its leaf switch (``nic_bw``). Leaves hold
``nodes_per_leaf`` nodes and reach the spine through one aggregate link each way of
``nodes_per_leaf * nic_bw / oversubscription`` (a two-level fat tree: 1.0 is full bisection).

A message pays the latencies of the levels it crosses once (alpha) and its bytes over the
slowest link of its path (beta). Concurrent messages on one link are serialised, first come
first served (``sharing = "fcfs"``, ``simulate._transmit``), or share it max-min fairly as TCP
flows do (``"fair"``, ``plan.links``). First come, first served holds every link of the path for
the message's time at its bottleneck rate, so an aggregate link (a leaf's uplink, ``nodes_per_leaf``
NICs wide) carries one NIC-rate message at a time: predictions whose messages cross the spine
need ``"fair"`` (docs/PERFORMANCE.md, issue 32.4).

The CPU (off by default: every ``cpu_*`` 0 and ``cores`` 0 keep the network-only model): a message
costs its sender and its receiver ``cpu_msg`` seconds plus ``cpu_byte`` per byte (system calls,
the copy into and out of the socket, the messaging library's threads), and a reduction
bytes / ``reduce_bw``. With ``cores`` > 0 that work runs on the ``cores`` of the rank's host
(``ranks_per_host`` ranks, a node by default), each piece on the core that frees first: ranks
beyond the cores take turns, as 8 processes on 2 cores do. ``cores`` 0: one core per rank.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from commrt.runtime.errors import ConfigError

SHARING = ("fcfs", "fair")
Link = tuple[str, int]  # (kind, index): ("out"|"in", rank), ("nic_up"|"nic_down", node), ("leaf_up"|"leaf_down", leaf)


@dataclass(frozen=True)
class Network:
    world: int
    per_node: int = 8
    intra_latency: float = 2e-6
    """seconds for a message between two ranks of a node"""
    intra_bw: float = 100e9
    """bytes/s of each rank's port into its node, each way"""
    nic_latency: float = 5e-6
    """seconds added when a message leaves the node (NIC, leaf switch)"""
    nic_bw: float = 25e9
    """bytes/s of a node's one NIC, each way (200 Gbit/s)"""
    nodes_per_leaf: int = 16
    spine_latency: float = 1e-6
    """seconds added when a message crosses the spine (another leaf)"""
    oversubscription: float = 1.0
    """a leaf's downlink bandwidth over its uplink bandwidth"""
    reduce_bw: float = 0.0
    """bytes/s a rank reduces (0: reduction costs nothing)"""
    cpu_msg: float = 0.0
    """CPU seconds a message costs its sender, and again its receiver"""
    cpu_byte: float = 0.0
    """CPU seconds per byte a message costs its sender, and again its receiver"""
    cores: int = 0
    """cores per host, shared by its ranks (0: one core per rank, no sharing)"""
    ranks_per_host: int = 0
    """ranks sharing a host's cores (0: a node's; an emulated cluster puts every node on one host)"""
    nic_burst: float = 0.0
    """bytes a node link sends at its port's speed after idling (a token bucket, as tc's tbf; 0: none)"""
    sharing: str = "fcfs"
    """how a link serves concurrent messages: "fcfs" (one after another) or "fair" (max-min shares)"""

    def __post_init__(self):
        # ConfigError (a ValueError): ``commrt estimate --simulate`` passes these straight from
        # its options, and inf or nan would pass a plain ``<= 0`` test (nan) or divide by zero
        # later (an infinite oversubscription makes the spine 0 B/s)
        if self.world < 1 or self.per_node < 1 or self.nodes_per_leaf < 1:
            raise ConfigError(f"network needs world, per_node, nodes_per_leaf >= 1: {self}")
        rates = {"intra_bw": self.intra_bw, "nic_bw": self.nic_bw, "oversubscription": self.oversubscription}
        bad = [k for k, v in rates.items() if not (0 < v < math.inf)]
        if bad:
            raise ConfigError(f"bandwidths and oversubscription must be finite and > 0, not {bad}: {self}")
        costs = {"intra_latency": self.intra_latency, "nic_latency": self.nic_latency,
                 "spine_latency": self.spine_latency, "cpu_msg": self.cpu_msg, "cpu_byte": self.cpu_byte,
                 "reduce_bw": self.reduce_bw, "cores": self.cores, "ranks_per_host": self.ranks_per_host,
                 "nic_burst": self.nic_burst}
        bad = [k for k, v in costs.items() if not (0 <= v < math.inf)]
        if bad:
            raise ConfigError(f"latencies, CPU costs, reduce_bw, cores, ranks_per_host and nic_burst must be "
                              f"finite and >= 0, not {bad}: {self}")
        if self.sharing not in SHARING:
            raise ConfigError(f"sharing {self.sharing!r} is not one of {SHARING}")

    @property
    def cpu_modelled(self) -> bool:
        return bool(self.cpu_msg or self.cpu_byte or self.cores)

    def host(self, rank: int) -> int:
        """The host whose cores ``rank`` shares (``cores`` > 0)."""
        return rank // (self.ranks_per_host or self.per_node)

    def cpu_seconds(self, nbytes: int, messages: int = 1) -> float:
        """CPU one side of ``messages`` messages of ``nbytes`` in all costs."""
        return self.cpu_msg * messages + nbytes * self.cpu_byte

    @property
    def spine_bw(self) -> float:
        return self.nodes_per_leaf * self.nic_bw / self.oversubscription

    def route(self, src: int, dst: int) -> tuple[tuple[Link, ...], float, float]:
        """(links crossed, latency, bottleneck bandwidth) of a message src -> dst."""
        a, b = src // self.per_node, dst // self.per_node
        if a == b:
            return (("out", src), ("in", dst)), self.intra_latency, self.intra_bw
        la, lb = a // self.nodes_per_leaf, b // self.nodes_per_leaf
        lat = self.intra_latency + self.nic_latency
        bw = min(self.intra_bw, self.nic_bw)
        if la == lb:
            return (("out", src), ("nic_up", a), ("nic_down", b), ("in", dst)), lat, bw
        return ((("out", src), ("nic_up", a), ("leaf_up", la), ("leaf_down", lb), ("nic_down", b), ("in", dst)),
                lat + self.spine_latency, min(bw, self.spine_bw))
