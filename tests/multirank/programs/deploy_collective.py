"""The collective job of the deploy recipes' tests: all_reduce (small and ring-sized), all_gather
and broadcast, each compared with a single-process reference built from every rank's inputs,
plus the node layout the scheduler mapping gave. argv: expected nodes, ranks per node."""
from __future__ import annotations

import sys

import numpy as np

import commrt
from tests.multirank.programs.np_ref import reference, values


def main() -> int:
    k, m = int(sys.argv[1]), int(sys.argv[2])
    commrt.init_process_group()
    rank, world = commrt.get_rank(), commrt.get_world_size()
    assert world == k * m and commrt.get_num_nodes() == k and commrt.get_node_rank() == rank // m, \
        (world, commrt.get_num_nodes(), commrt.get_node_rank())
    for numel in (5, 300_001):  # the direct exchange, then the ring
        parts = [values(numel, r, np.float32, "SUM", seed=7) for r in range(world)]
        t = parts[rank].copy()
        commrt.all_reduce(t)
        assert np.array_equal(t, reference(parts, "SUM")), f"all_reduce of {numel} differs"
        out = np.empty(world * numel, np.float32)
        commrt.all_gather_into_tensor(out, parts[rank])
        assert np.array_equal(out, np.concatenate(parts)), "all_gather differs"
    b = parts[world - 1].copy() if rank == world - 1 else np.zeros(300_001, np.float32)
    commrt.broadcast(b, src=world - 1)
    assert np.array_equal(b, parts[world - 1]), "broadcast differs"
    print(f"rank {rank}: deploy collective passed on {k} nodes x {m} ranks", flush=True)
    commrt.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
