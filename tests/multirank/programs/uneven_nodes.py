"""A world whose nodes hold different numbers of ranks (argv: the node sizes, e.g. 3 1), set
through torchrun's variables before init: every rank must see the same layout, take the same
(flat) path and agree on what the two-level helpers say, with no rank left waiting."""
from __future__ import annotations

import os
import sys

import numpy as np
import torch

import commrt
import commrt.quant as cq
from commrt.runtime.errors import ConfigError


def set_layout(sizes: list[int]) -> None:
    rank, first = int(os.environ["RANK"]), 0
    for node, size in enumerate(sizes):
        if rank < first + size:
            os.environ.update(GROUP_RANK=str(node), LOCAL_RANK=str(rank - first), LOCAL_WORLD_SIZE=str(size))
            return
        first += size


def check_links() -> None:
    """measure_links is collective: every rank must get the same answer (None: no uniform levels)."""
    from commrt.train import groups
    from commrt.topology import mesh
    links = groups.measure_links()
    assert links is None, links
    try:
        mesh.node_groups()
        raise AssertionError("node_groups on uneven nodes was accepted")
    except ConfigError as exc:
        assert "node sizes" in str(exc), exc


def check_collectives(world: int, rank: int) -> None:
    parts = [np.random.default_rng(r).standard_normal(3001).astype(np.float32) for r in range(world)]
    t = torch.from_numpy(parts[rank].copy())
    commrt.all_reduce(t)
    assert np.allclose(t.numpy(), np.sum(parts, 0), atol=1e-5)
    q = torch.from_numpy(parts[rank].copy())
    commrt.all_reduce(q, quant="int8")
    assert np.abs(q.numpy() - np.sum(parts, 0)).max() < 0.2


def check_engine(world: int) -> None:
    """"auto" sharding plans from the layout: the same plan on every rank, whatever its node."""
    from torch import nn
    from commrt.train import initialize
    for zero in ({"stage": 3, "sharding_strategy": "auto"}, {"stage": 3, "zero_hpz_partition_size": "auto"}):
        engine = initialize(nn.Linear(8, 8), {"zero_optimization": zero, "optimizer": {"type": "sgd", "params": {"lr": 0.1}}})
        mine = torch.tensor(list(engine.plan), dtype=torch.int64)
        every = torch.empty(world * mine.numel(), dtype=torch.int64)
        commrt.all_gather_into_tensor(every, mine, group=commrt.new_group(list(range(world))))
        assert all(torch.equal(row, mine) for row in every.view(world, -1)), (zero, every)
        assert tuple(engine.plan) == (3, world, 1, 0), (zero, engine.plan)  # no uniform nodes: no hierarchy
        engine.close()


def main() -> None:
    sizes = [int(s) for s in sys.argv[1:]]
    set_layout(sizes)
    commrt.init_process_group()
    try:
        rank, world = commrt.get_rank(), commrt.get_world_size()
        assert commrt.get_num_nodes() == len(sizes)
        check_links()
        check_collectives(world, rank)
        check_engine(world)
        commrt.barrier()
        print(f"rank {rank}: uneven passed", flush=True)
    finally:
        commrt.destroy_process_group()


if __name__ == "__main__":
    main()
