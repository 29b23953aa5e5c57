"""The process groups a sharding plan needs. Every rank creates every group, in the same order
(``new_group`` is collective over the world, as in torch), and keeps the ones it belongs to.
A device mesh ((replicas, shard) over the world) would hand out the same two groups."""
from __future__ import annotations

import time
from typing import NamedTuple

import torch

from commrt import distributed as dist
from commrt.topology import mesh
from commrt.runtime.errors import ConfigError
from commrt.train.sharding import Links, Plan


class ShardGroups(NamedTuple):
    shard: object = None      # units are sharded over it (None: the engine's group)
    replica: object = None    # hybrid: the ranks holding the same shard (None: no replicas)
    secondary: object = None  # hpZ: the in-node group sharing one secondary copy


def ranks_per_node() -> int:
    """Ranks on every node of the runtime's topology (torchrun's variables, or which ranks share
    a host), or 0 when nodes hold different numbers: the sharding plan is collective, so it
    must see the same count on every rank, not each rank's own ``get_local_world_size``."""
    return mesh.get_uniform_local_world_size()


def measure_levels(nbytes: int = 4 << 20, rounds: int = 3) -> dict[str, float]:
    """Bus bandwidth (bytes/s) of an all_reduce over this rank's node ("intra") and over the
    same local rank on every node ("inter"; all local ranks at once, so they share the node's
    link as training shares it): the slowest rank's time, so every rank gets the same figures.
    Only the levels of two or more ranks; collective over the world."""
    levels = dict(zip(("intra", "inter"), mesh.node_groups()))
    sizes = {k: dist.get_world_size(g) for k, g in levels.items()}
    levels = {k: g for k, g in levels.items() if sizes[k] > 1}
    buf = torch.zeros(max(1, nbytes // 4))
    took = torch.zeros(max(1, len(levels)), dtype=torch.float64)
    for i, g in enumerate(levels.values()):
        dist.all_reduce(buf, group=g)  # first use: connections, pages
        start = time.perf_counter()
        for _ in range(rounds):
            dist.all_reduce(buf, group=g)
        took[i] = (time.perf_counter() - start) / rounds
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return {k: 2 * (sizes[k] - 1) / sizes[k] * buf.numel() * 4 / max(float(t), 1e-9)
            for k, t in zip(levels, took)}


def measure_links(nbytes: int = 4 << 20, rounds: int = 3) -> Links | None:
    """``measure_levels`` as the sharding plan's Links; None on one node, one rank per node or
    nodes of different sizes (decided from the whole layout, so every rank returns alike)."""
    if mesh.get_num_nodes() < 2 or mesh.get_uniform_local_world_size() < 2:
        return None
    found = measure_levels(nbytes, rounds)
    return Links(found["intra"], found["inter"])


def shard_and_replica_groups(world_size: int, rank: int, shard_size: int):
    """(this rank's group of ``shard_size`` consecutive ranks, its group of the ranks at the
    same position in every such group)."""
    mine = [None, None]
    for lo in range(0, world_size, shard_size):
        g = dist.new_group(list(range(lo, lo + shard_size)))
        if lo <= rank < lo + shard_size:
            mine[0] = g
    for pos in range(shard_size):
        g = dist.new_group(list(range(pos, world_size, shard_size)))
        if rank % shard_size == pos:
            mine[1] = g
    return mine[0], mine[1]


def build(p: Plan, group=None) -> ShardGroups:
    world = dist.get_world_size(group)
    if p.replicas == 1 and not p.secondary:
        return ShardGroups()
    if world != dist.get_world_size():
        raise ConfigError(f"hybrid sharding and hpZ build their groups over the whole world ({dist.get_world_size()} "
                          f"ranks), not over a group of {world}; pass group=None")
    rank = dist.get_rank()
    if p.secondary:
        secondary, _ = shard_and_replica_groups(world, rank, p.secondary)
        return ShardGroups(secondary=secondary)
    shard, replica = shard_and_replica_groups(world, rank, p.shard)
    return ShardGroups(shard=shard, replica=replica)
