"""Error feedback across a size change: a tensor's memory kept from a call of another size must
not compensate the new one. A feedback object that saw 10 values, then 11, gives the same bits
as a fresh one on 11 (with 2 ranks, rank 1's all_reduce shard keeps its length, 5, but moves
from elements 5..9 to 6..10)."""
from __future__ import annotations

import numpy as np
import torch

import commrt
import commrt.quant as cq


def main() -> None:
    commrt.init_process_group()
    try:
        rank = commrt.get_rank()
        rng = np.random.default_rng(rank)
        small = torch.from_numpy(rng.standard_normal(10).astype(np.float32))
        big = torch.from_numpy(rng.standard_normal(11).astype(np.float32))
        seen, fresh = cq.ErrorFeedback(0.5), cq.ErrorFeedback(0.5)
        cq.all_reduce(small.clone(), quant="int4", block=4, feedback=seen)
        a, b = big.clone(), big.clone()
        cq.all_reduce(a, quant="int4", block=4, feedback=seen)
        cq.all_reduce(b, quant="int4", block=4, feedback=fresh)
        assert torch.equal(a, b), f"rank {rank}: memory of 10 values used on 11: {a} vs {b}"
        print(f"rank {rank}: quant feedback passed", flush=True)
    finally:
        commrt.destroy_process_group()


if __name__ == "__main__":
    main()
