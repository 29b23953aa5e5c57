"""Messages one rank sends per small all_reduce (the default table: recursive doubling), as
comm_stats() counts them; printed for the test to compare across world sizes."""
from __future__ import annotations

import torch

import commrt


def main() -> None:
    commrt.init_process_group()
    rank, n = commrt.get_rank(), commrt.get_world_size()
    t = torch.arange(1024, dtype=torch.float32)  # 4 KiB
    commrt.all_reduce(t)  # connects; not counted
    before = commrt.comm_stats()["by_op"]["all_reduce"]["messages"]
    for _ in range(10):
        t = torch.full((1024,), float(rank))
        commrt.all_reduce(t)
        assert torch.equal(t, torch.full((1024,), float(n * (n - 1) // 2))), t[:4]
    per_op = (commrt.comm_stats()["by_op"]["all_reduce"]["messages"] - before) / 10
    print(f"rank {rank}: messages per all_reduce {per_op:g}", flush=True)
    commrt.destroy_process_group()


if __name__ == "__main__":
    main()
