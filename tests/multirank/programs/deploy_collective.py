"""The collective job of the deploy recipes' tests: all_reduce (small and ring-sized), all_gather
and broadcast, each compared with a single-process reference built from every rank's inputs,
plus the node layout the scheduler mapping gave. argv: expected nodes, ranks per node."""
from __future__ import annotations

import sys

import torch

import commrt
from tests.multirank.programs.common import reference, values


def main() -> int:
    k, m = int(sys.argv[1]), int(sys.argv[2])
    commrt.init_process_group()
    rank, world = commrt.get_rank(), commrt.get_world_size()
    assert world == k * m and commrt.get_num_nodes() == k and commrt.get_node_rank() == rank // m, \
        (world, commrt.get_num_nodes(), commrt.get_node_rank())
    for numel in (5, 300_001):  # the direct exchange, then the ring
        parts = [values(numel, r, torch.float32, "SUM", seed=7) for r in range(world)]
        t = parts[rank].clone()
        commrt.all_reduce(t)
        assert torch.equal(t, reference(parts, "SUM")), f"all_reduce of {numel} differs"
        out = torch.empty(world * numel)
        commrt.all_gather_into_tensor(out, parts[rank])
        assert torch.equal(out, torch.cat(parts)), "all_gather differs"
    b = parts[world - 1].clone() if rank == world - 1 else torch.zeros(300_001)
    commrt.broadcast(b, src=world - 1)
    assert torch.equal(b, parts[world - 1]), "broadcast differs"
    print(f"rank {rank}: deploy collective passed on {k} nodes x {m} ranks", flush=True)
    commrt.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
