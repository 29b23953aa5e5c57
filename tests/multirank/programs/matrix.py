"""Every collective x dtype x op x size against the single-process reference.
Backend from COMMRT_COMM_BACKEND; run with any world size."""
from __future__ import annotations

import torch

import commrt
from tests.multirank.programs.common import DTYPES, OPS, assert_equal, init, reference, values

SIZES = [0, 1, 7, 1003, 70001]  # 70001: past the small-message threshold for every dtype
SHARD_SIZES = [0, 1, 5, 20001]


def main() -> None:
    rank, n = init()
    seed = 0
    for dtype in DTYPES:
        for op in OPS:
            for numel in SIZES:
                seed += 1
                parts = [values(numel, r, dtype, op, seed) for r in range(n)]
                want = reference(parts, op)
                t = parts[rank].clone()
                commrt.all_reduce(t, op=getattr(commrt.ReduceOp, op))
                assert_equal(t, want, f"all_reduce {dtype} {op} n={numel}")

                dst = seed % n
                t = parts[rank].clone()
                commrt.reduce(t, dst=dst, op=op)
                assert_equal(t, want if rank == dst else parts[rank], f"reduce dst={dst} {dtype} {op} n={numel}")
            for m in SHARD_SIZES:
                seed += 1
                parts = [values(m * n, r, dtype, op, seed) for r in range(n)]
                out = torch.full((m,), 99, dtype=dtype)
                commrt.reduce_scatter_tensor(out, parts[rank], op=op)
                assert_equal(out, reference(parts, op)[rank * m:(rank + 1) * m],
                             f"reduce_scatter {dtype} {op} m={m}")
                assert_equal(parts[rank], values(m * n, rank, dtype, op, seed), "reduce_scatter input untouched")
        for m in SHARD_SIZES:
            seed += 1
            parts = [values(m, r, dtype, "SUM", seed) for r in range(n)]
            out = torch.zeros(m * n, dtype=dtype)
            commrt.all_gather_into_tensor(out, parts[rank])
            assert_equal(out, torch.cat(parts), f"all_gather {dtype} m={m}")
        for numel in SIZES:
            seed += 1
            src = seed % n
            t = values(numel, rank, dtype, "SUM", seed)
            commrt.broadcast(t, src=src)
            assert_equal(t, values(numel, src, dtype, "SUM", seed), f"broadcast src={src} {dtype} n={numel}")
        seed += 1
        check_all_to_all(rank, n, dtype, seed)
        seed += 1
        check_in_place(rank, n, dtype, seed)
    check_zero_copy_sizes(rank, n, seed + 1)
    commrt.barrier()
    commrt.destroy_process_group()
    print(f"rank {rank}: matrix passed on {n} ranks", flush=True)


def check_zero_copy_sizes(rank: int, n: int, seed: int) -> None:
    """Pieces of 1 MiB and more are sent from our own memory (zero-copy): the results must be
    exact and the inputs untouched, at the default piece size."""
    numel, m = 1_300_000, 400_000  # every ring piece >= 1 MiB at n <= 4
    for op in ("SUM", "MAX"):
        parts = [values(numel, r, torch.float32, op, seed) for r in range(n)]
        t = parts[rank].clone()
        commrt.all_reduce(t, op=op)
        assert_equal(t, reference(parts, op), f"zero-copy all_reduce {op}")
        shards = [values(m * n, r, torch.float32, op, seed + 1) for r in range(n)]
        out = torch.zeros(m)
        commrt.reduce_scatter_tensor(out, shards[rank], op=op)
        assert_equal(out, reference(shards, op)[rank * m:(rank + 1) * m], f"zero-copy reduce_scatter {op}")
        assert_equal(shards[rank], values(m * n, rank, torch.float32, op, seed + 1), "zero-copy input untouched")
    out = torch.zeros(m * n)
    commrt.all_gather_into_tensor(out, shards[rank][:m])
    assert_equal(out, torch.cat([s[:m] for s in shards]), "zero-copy all_gather")
    t = parts[rank].clone()
    commrt.broadcast(t, src=n - 1)
    assert_equal(t, parts[n - 1], "zero-copy broadcast")


def check_in_place(rank: int, n: int, dtype: torch.dtype, seed: int) -> None:
    """The in-place forms NCCL documents: reduce_scatter's output is the input's own slice,
    all_gather's input is the output's own slice; plus overlaps that are not a rank's own slice
    (output at the front of the input) and all_to_all_single with output and input one tensor.
    all_reduce, broadcast and reduce are in place by nature (tested above). Aliasing does not
    depend on the element-wise op: SUM, AVG (its final division) and MAX stand for all five."""
    for op in ("SUM", "AVG", "MAX"):
        for m in SHARD_SIZES:
            seed += 1
            parts = [values(m * n, r, dtype, op, seed) for r in range(n)]
            want = reference(parts, op)[rank * m:(rank + 1) * m]
            for lo, form in ((rank * m, "own slice"), (0, "front")):
                buf = parts[rank].clone()
                commrt.reduce_scatter_tensor(buf[lo:lo + m], buf, op=op)
                assert_equal(buf[lo:lo + m], want, f"in-place reduce_scatter ({form}) {dtype} {op} m={m}")
    for m in SHARD_SIZES:
        seed += 1
        parts = [values(m, r, dtype, "SUM", seed) for r in range(n)]
        for lo, form in ((rank * m, "own slice"), (0, "front")):
            out = torch.full((m * n,), 55, dtype=dtype)
            out[lo:lo + m] = parts[rank]
            commrt.all_gather_into_tensor(out, out[lo:lo + m])
            assert_equal(out, torch.cat(parts), f"in-place all_gather ({form}) {dtype} m={m}")
    for rows in (4, 20001):
        seed += 1
        t = values(rows * n, rank, dtype, "SUM", seed)
        commrt.all_to_all_single(t, t)
        want = [values(rows * n, j, dtype, "SUM", seed)[rows * rank:rows * (rank + 1)] for j in range(n)]
        assert_equal(t, torch.cat(want), f"all_to_all_single output is input {dtype} rows={rows}")


def check_all_to_all(rank: int, n: int, dtype: torch.dtype, seed: int) -> None:
    """Uneven splits: rank r sends (r + j) % 3 rows of 3 elements to rank j."""
    rows = lambda r, j: (r + j) % 3
    blocks = {(r, j): values(rows(r, j) * 3, r * n + j, dtype, "SUM", seed).view(-1, 3)
              for r in range(n) for j in range(n)}
    inp = torch.cat([blocks[rank, j] for j in range(n)])
    out = torch.full((sum(rows(j, rank) for j in range(n)), 3), 77, dtype=dtype)
    commrt.all_to_all_single(out, inp, [rows(j, rank) for j in range(n)], [rows(rank, j) for j in range(n)])
    assert_equal(out, torch.cat([blocks[j, rank] for j in range(n)]), f"all_to_all {dtype}")
    even_in = values(4 * n, rank, dtype, "SUM", seed + 1)
    even_out = torch.empty_like(even_in)
    commrt.all_to_all_single(even_out, even_in)
    want = torch.cat([values(4 * n, j, dtype, "SUM", seed + 1)[4 * rank:4 * rank + 4] for j in range(n)])
    assert_equal(even_out, want, f"all_to_all even {dtype}")


if __name__ == "__main__":
    main()
