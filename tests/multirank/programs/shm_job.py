"""Every collective on the shared-memory path against the single-process reference.

    shm_job [SLOT_BYTES]

SLOT_BYTES (``[comm] shm_slot_bytes``; default: the config's) shrinks the segments' slots so
that modest sizes run many pipelined rounds. Prints ``segments: NAMES`` (the group's segment names, for the test's
/dev/shm check) and ``shm passed``."""
from __future__ import annotations

import os
import sys

import torch

import commrt
from commrt import distributed
from commrt.transport import shm
from tests.multirank.programs.common import assert_equal, reference, values

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64]


def _channel():
    chan = distributed._rt().world.backend._shm
    if os.environ.get("COMMRT_COMM_INTRA_NODE", "auto") != "tcp":
        assert chan is not None, "the world group of one node should run on shared memory"
        print("segments:", " ".join(chan.names), flush=True)
    return chan


def check_reductions(rank: int, n: int, sizes: list[int]) -> None:
    seed = 0
    for dtype in DTYPES:
        for op in ["SUM", "AVG", "MAX"]:
            for numel in sizes:
                seed += 1
                parts = [values(numel, r, dtype, op, seed) for r in range(n)]
                want = reference(parts, op)
                t = parts[rank].clone()
                commrt.all_reduce(t, op=op)
                assert_equal(t, want, f"all_reduce {dtype} {op} n={numel}")
                dst = seed % n
                t = parts[rank].clone()
                commrt.reduce(t, dst=dst, op=op)
                assert_equal(t, want if rank == dst else parts[rank], f"reduce dst={dst} {dtype} {op}")
                m = numel // n + 1
                parts = [values(m * n, r, dtype, op, seed) for r in range(n)]
                want = reference(parts, op)[rank * m:(rank + 1) * m]
                out = torch.full((m,), 9, dtype=dtype)
                commrt.reduce_scatter_tensor(out, parts[rank], op=op)
                assert_equal(out, want, f"reduce_scatter {dtype} {op} m={m}")
                inp = parts[rank].clone()  # the in-place form: the output is the input's own slice
                commrt.reduce_scatter_tensor(inp[rank * m:(rank + 1) * m], inp, op=op)
                assert_equal(inp[rank * m:(rank + 1) * m], want, f"in-place reduce_scatter {dtype} {op}")


def check_movement(rank: int, n: int, sizes: list[int]) -> None:
    seed = 100
    for dtype in DTYPES:
        for numel in sizes:
            seed += 1
            parts = [values(numel, r, dtype, "SUM", seed) for r in range(n)]
            out = torch.zeros(numel * n, dtype=dtype)
            commrt.all_gather_into_tensor(out, parts[rank])
            assert_equal(out, torch.cat(parts), f"all_gather {dtype} m={numel}")
            out = torch.zeros(numel * n, dtype=dtype)
            out[rank * numel:(rank + 1) * numel] = parts[rank]
            commrt.all_gather_into_tensor(out, out[rank * numel:(rank + 1) * numel])
            assert_equal(out, torch.cat(parts), f"in-place all_gather {dtype} m={numel}")
            src = seed % n
            t = parts[rank].clone()
            commrt.broadcast(t, src=src)
            assert_equal(t, parts[src], f"broadcast src={src} {dtype}")
            # uneven all_to_all: rank r sends (r + j) % 3 * numel // 4 + 1 rows to rank j
            rows = lambda s, d: (s + d) % 3 * (numel // 4) + 1
            send = [values(rows(rank, j), rank * 31 + j, dtype, "SUM", seed) for j in range(n)]
            got = torch.empty(sum(rows(s, rank) for s in range(n)), dtype=dtype)
            commrt.all_to_all_single(got, torch.cat(send), [rows(s, rank) for s in range(n)],
                                     [rows(rank, j) for j in range(n)])
            want = torch.cat([values(rows(s, rank), s * 31 + rank, dtype, "SUM", seed) for s in range(n)])
            assert_equal(got, want, f"all_to_all {dtype} numel={numel}")
            commrt.barrier()


def check_bit_identical(rank: int, n: int, numel: int) -> None:
    """Random fp32 (rounding depends on order): every rank must hold the very same bits."""
    g = torch.Generator().manual_seed(rank)
    for op in ["SUM", "AVG"]:
        t = torch.randn(numel, generator=g)
        commrt.all_reduce(t, op=op)
        rows = torch.empty(n * numel)
        commrt.all_gather_into_tensor(rows, t)
        for r in range(n):
            assert torch.equal(rows[r * numel:(r + 1) * numel], t), f"rank {r}'s {op} differs from rank {rank}'s"


def main() -> int:
    if len(sys.argv) > 1:
        os.environ["COMMRT_COMM_SHM_SLOT_BYTES"] = sys.argv[1]
    print(f"pid: {os.getpid()}", flush=True)
    commrt.init_process_group()
    rank, n = commrt.get_rank(), commrt.get_world_size()
    slot = _channel().slot_bytes
    assert len(sys.argv) == 1 or slot == int(sys.argv[1]), slot
    sizes = [1, 1003, 3 * slot // 8 + 5]  # the last runs several pipelined rounds in every dtype
    check_reductions(rank, n, sizes)
    check_movement(rank, n, sizes)
    check_bit_identical(rank, n, slot // 2 + 7)
    commrt.destroy_process_group()
    print("shm passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
