"""float16 / bfloat16 AVG of values whose sum over the ranks passes float16's largest value
(65504) while their mean fits: all_reduce, reduce_scatter_tensor (also in place) and reduce, on
tensors and numpy float16 arrays, against the exact mean. The sum used to overflow to inf before
the division; each rank's part is divided first now (reduce_ops.avg_part). Random values must
come out bit-identical on every rank and near the float64 mean.

    half_avg
"""
from __future__ import annotations

import numpy as np
import torch

import commrt

SIZES = [0, 1, 7, 70001]  # 70001: past the small-message threshold (ring, shm rounds)
ATOL = {torch.float16: 8.0, torch.bfloat16: 64.0}  # a few ulps of the partial sums (|x| ~ 1000s)


def quarters(numel: int, rank: int, n: int, seed: int) -> np.ndarray:
    """int64 c with n * c about 40000, multiples of 256: rank r's value is n * c (exact in both
    types), the mean is the sum of the c (exact too), the sum of the values is n times that."""
    c = 256 * (40000 // (256 * n) + (np.arange(numel) + rank + seed) % 3)
    c[1::4] *= -1
    return c


def as_dtype(a: np.ndarray, dtype, kind: str):
    t = torch.from_numpy(a).to(dtype)
    return t.numpy() if kind == "numpy" else t


def check(got, want, what: str) -> None:
    got = torch.as_tensor(got).double()
    assert torch.equal(got, torch.as_tensor(want).double()), f"{what}: got {got[:6].tolist()} want {want[:6]}"


def same_everywhere(t, what: str) -> None:
    raw = torch.as_tensor(t).reshape(-1).view(torch.uint8)
    rows = torch.empty(raw.numel() * commrt.get_world_size(), dtype=torch.uint8)
    commrt.all_gather_into_tensor(rows, raw)
    rows = rows.view(commrt.get_world_size(), -1)
    assert all(torch.equal(rows[0], r) for r in rows), f"{what}: ranks differ"


def checks() -> None:
    """Every check, on the initialized world (programs/dtype_ops.py runs it beside the others)."""
    rank, n = commrt.get_rank(), commrt.get_world_size()
    seed = 0
    for dtype, kind in ((torch.float16, "torch"), (torch.bfloat16, "torch"), (torch.float16, "numpy")):
        for numel in SIZES:
            seed += 1
            what = f"{kind} {dtype} numel={numel}"
            want = sum(quarters(numel, r, n, seed) for r in range(n)) if numel else np.zeros(0)
            mine = quarters(numel, rank, n, seed) * n
            t = as_dtype(mine, dtype, kind)
            commrt.all_reduce(t, op="avg")
            check(t, want, f"all_reduce {what}")
            t = as_dtype(mine, dtype, kind)
            commrt.reduce(t, dst=seed % n, op="avg")
            check(t, want if rank == seed % n else mine, f"reduce {what}")
            full = [quarters(numel * n, r, n, seed) for r in range(n)]
            inp = as_dtype(full[rank] * n, dtype, kind)
            out = as_dtype(np.zeros(numel, np.int64), dtype, kind)
            commrt.reduce_scatter_tensor(out, inp, op="avg")
            check(out, sum(full)[rank * numel:(rank + 1) * numel], f"reduce_scatter {what}")
            check(inp, full[rank] * n, f"reduce_scatter input untouched {what}")
            commrt.reduce_scatter_tensor(inp[rank * numel:(rank + 1) * numel], inp, op="avg")
            check(inp[rank * numel:(rank + 1) * numel], sum(full)[rank * numel:(rank + 1) * numel],
                  f"in-place reduce_scatter {what}")
            rng = np.random.default_rng(seed * 100 + rank)
            x = as_dtype(rng.standard_normal(numel) * 1000, dtype, kind)
            parts = [torch.from_numpy(np.random.default_rng(seed * 100 + r).standard_normal(numel) * 1000)
                     .to(dtype).double() for r in range(n)]
            commrt.all_reduce(x, op="avg")
            mean = torch.stack(parts).mean(0) if numel else torch.zeros(0, dtype=torch.double)
            assert torch.allclose(torch.as_tensor(x).double(), mean, rtol=2e-2, atol=ATOL[dtype]), f"random {what}"
            if numel:
                same_everywhere(x, f"random all_reduce {what}")
    commrt.barrier()
    print(f"rank {rank}: half avg passed", flush=True)


def main() -> None:
    commrt.init_process_group()
    checks()
    commrt.destroy_process_group()


if __name__ == "__main__":
    main()
