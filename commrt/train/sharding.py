"""How a ZeRO config lays its shards over the ranks once the world is known: a pure function.

    plain     units sharded over every rank (ZeRO 1-3, FSDP FULL_SHARD / SHARD_GRAD_OP)
    hybrid    units sharded over each group of ``shard`` consecutive ranks (a node), the same
              shard replicated on the matching rank of every group (FSDP HYBRID_SHARD, DeepSpeed
              MiCS; Zhang et al., "MiCS: Near-linear Scaling for Training Gigantic Model on
              Public Cloud", 2022): gradients reduce-scattered inside the group, then averaged
              across the groups on the shard alone
    hpZ       stage 3 sharded over every rank, plus a secondary copy of the parameters sharded
              over each group of ``secondary`` ranks (ZeRO++, Wang et al. 2023, section 3.2):
              backward gathers read the secondary copy and never leave the node
"""
from __future__ import annotations

import logging
from typing import NamedTuple

from commrt.runtime.errors import ConfigError
from commrt.train.config import ZeroConfig

log = logging.getLogger(__name__)


class Links(NamedTuple):
    """Bus bandwidth measured once at start-up inside a node and across nodes (bytes/s)."""
    intra: float
    inter: float


# A two-level layout pays when the link between nodes is this much slower than the path inside
# one: hybrid sharding and hpZ trade more traffic inside the node for less across, which is a
# loss on a flat network (one switch, or ranks that only look like separate nodes).
HIERARCHY_PAYS = 1.5


def hierarchy_pays(links: Links | None) -> bool:
    return links is None or links.inter * HIERARCHY_PAYS <= links.intra


def _why(links: Links | None) -> str:
    if links is None:
        return "from the topology alone"
    return (f"measured {links.intra / 1e9:.2f} GB/s inside a node, {links.inter / 1e9:.2f} GB/s across: "
            f"{'' if hierarchy_pays(links) else 'not '}at least {HIERARCHY_PAYS}x apart")


class Plan(NamedTuple):
    stage: int
    shard: int       # ranks one unit is sharded over (the world size unless hybrid)
    replicas: int    # hybrid: shard groups, each holding every shard once; 1 otherwise
    secondary: int   # hpZ: ranks holding one secondary copy; 0 when off


def plan(z: ZeroConfig, world: int, per_node: int, links: Links | None = None) -> Plan:
    """The layout for ``world`` ranks with ``per_node`` of them on each node (0: nodes of
    different sizes, which "auto" treats as no nodes), or a ConfigError that says which sizes
    would work. ``links``: the bandwidths measured at start-up, which the
    "auto" settings weigh (None: decide from the topology alone)."""
    stage, hybrid = z.stage, z.hybrid
    hpz = z.zero_hpz_partition_size
    if z.sharding_strategy == "auto":  # the group is the node; hybrid only when there are nodes
        stage = 3 if stage == 0 else stage
        nodes = 0 < per_node and 1 < world // per_node and world % per_node == 0
        hybrid = stage >= 2 and nodes and hierarchy_pays(links)
        log.info("sharding_strategy auto: stage %d, %s (world %d, %d ranks per node; %s)", stage,
                 "sharded inside each node, replicated across nodes" if hybrid else "sharded over every rank",
                 world, per_node, _why(links))
    if hpz == "auto":
        nodes = 1 < per_node < world and world % per_node == 0
        hpz = per_node if nodes and hierarchy_pays(links) else 1
        log.info("zero_hpz_partition_size auto: %d (world %d, %d ranks per node; %s)", hpz, world, per_node,
                 _why(links))
    if hybrid:
        size = z.mics_shard_size if z.mics_shard_size > 0 else z.shard_group_size or per_node
        what = "mics_shard_size" if z.mics_shard_size > 0 else "the shard group size"
        if size < 1:
            raise ConfigError("hybrid sharding's shard group defaults to the node, but this job's nodes hold "
                              "different numbers of ranks; set shard_group_size (or mics_shard_size)")
        _fits(size, world, what)
        return Plan(stage, size, world // size, 0)
    if hpz > 1:
        _fits(hpz, world, "zero_hpz_partition_size")
        return Plan(stage, world, 1, 0 if hpz == world else hpz)
    return Plan(stage, world, 1, 0)


def _fits(size: int, world: int, what: str) -> None:
    if size > world:  # instructlab/training 678: a node size larger than a small job
        raise ConfigError(f"{what} = {size} is larger than the world of {world} rank(s); use a size that "
                          f"divides {world}: {divisors(world)}")
    if world % size:
        raise ConfigError(f"{what} = {size} does not divide the world of {world} ranks; valid: {divisors(world)}")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]

