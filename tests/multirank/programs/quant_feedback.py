"""Error feedback across a size change: a tensor's memory kept from a call of another size must
not compensate the new one. A feedback object that saw 10 values, then 11, gives the same bits
as a fresh one on 11 (with 2 ranks, rank 1's all_reduce shard keeps its length, 5, but moves
from elements 5..9 to 6..10)."""
from __future__ import annotations

import numpy as np
import torch

import commrt
import commrt.quant as cq


def check_failed_call(rank: int) -> None:
    """A call that raised (rank 1's NaN) leaves the memory as it was, its call count too: with
    reset_T = 2 it counted as the second call, so the next one reset the memory."""
    x = torch.from_numpy(np.random.default_rng(10 + rank).standard_normal(64).astype(np.float32))
    failed, clean = cq.ErrorFeedback(0.5, reset_T=2), cq.ErrorFeedback(0.5, reset_T=2)
    for fb in (failed, clean):
        cq.all_reduce(x.clone(), quant="int4", block=8, feedback=fb)
    bad = x.clone()
    if rank == 1:
        bad[3] = float("nan")
    try:
        cq.all_reduce(bad, quant="int4", block=8, feedback=failed)
        raise AssertionError("a NaN was accepted")
    except ValueError:
        pass
    a, b = x.clone(), x.clone()
    cq.all_reduce(a, quant="int4", block=8, feedback=failed)
    cq.all_reduce(b, quant="int4", block=8, feedback=clean)
    assert torch.equal(a, b), f"rank {rank}: a failed call changed the memory: {a[:4]} vs {b[:4]}"


def checks() -> None:
    """Both checks, on the initialized world of 2 (programs/quant_train.py runs them after its own)."""
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
    check_failed_call(rank)
    print(f"rank {rank}: quant feedback passed", flush=True)


def main() -> None:
    commrt.init_process_group()
    try:
        checks()
    finally:
        commrt.destroy_process_group()


if __name__ == "__main__":
    main()
