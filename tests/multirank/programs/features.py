"""Async handles, sub-groups, point-to-point, numpy arrays, non-contiguous tensors.
Backend from COMMRT_COMM_BACKEND."""
from __future__ import annotations

import numpy as np
import torch

import commrt
from tests.multirank.programs.common import assert_equal, init, reference, values


def check_async(rank: int, n: int) -> None:
    """Several ops in flight at once, on the world and on a sub-group, issued before any wait."""
    evens = commrt.new_group([r for r in range(n) if r % 2 == 0])
    big = [values(300_000, r, torch.float32, "SUM", 1) for r in range(n)]
    small = [values(5, r, torch.int64, "MAX", 2) for r in range(n)]
    sub = [values(50_000, r, torch.float64, "SUM", 3) for r in range(n)]
    t_big, t_small, t_sub = big[rank].clone(), small[rank].clone(), sub[rank].clone()
    works = [commrt.all_reduce(t_big, async_op=True), commrt.all_reduce(t_small, op="MAX", async_op=True)]
    if evens is not commrt.NON_GROUP_MEMBER:
        works.append(commrt.all_reduce(t_sub, group=evens, async_op=True))
    out = torch.empty(4 * n, dtype=torch.int32)
    works.append(commrt.all_gather_into_tensor(out, torch.full((4,), rank, dtype=torch.int32), async_op=True))
    for w in works:
        assert w.wait(timeout=60)
        assert w.is_completed()
    assert_equal(t_big, reference(big, "SUM"), "async big")
    assert_equal(t_small, reference(small, "MAX"), "async small")
    if evens is not commrt.NON_GROUP_MEMBER:
        members = list(range(0, n, 2))
        assert commrt.get_world_size(evens) == len(members)
        assert commrt.get_rank(evens) == members.index(rank)
        assert_equal(t_sub, reference([sub[r] for r in members], "SUM"), "async sub-group")
    else:
        assert commrt.all_reduce(t_sub, group=evens) is None
    assert_equal(out, torch.arange(n, dtype=torch.int32).repeat_interleave(4), "async all_gather")


def check_independent_groups(rank: int, n: int) -> None:
    """Groups progress independently: rank 0's world all_reduce cannot finish before rank 1 joins
    it, and rank 1 joins only after an all_reduce on another group (ranks 0 and 1) finished; if
    one group's waiting op held up the other group, rank 0 would never get there (a timeout)."""
    pair = commrt.new_group([0, 1]) if n > 1 else None
    if n == 1:
        return
    t, u = torch.full((4,), float(rank)), torch.full((3,), float(rank + 1))
    if rank == 0:
        work = commrt.all_reduce(t, async_op=True)
        commrt.all_reduce(u, group=pair)
        assert work.wait(timeout=60)
    elif rank == 1:
        commrt.all_reduce(u, group=pair)
        commrt.all_reduce(t)
    else:
        commrt.all_reduce(t)
    assert_equal(t, torch.full((4,), float(sum(range(n)))), "world op beside another group's")
    if rank < 2:
        assert_equal(u, torch.full((3,), 3.0), "pair op while the world op waits")


def check_groups(rank: int, n: int) -> None:
    """Broadcast inside a group takes a global src rank, like torch."""
    tail = commrt.new_group(list(range(1, n))) if n > 1 else None
    if tail is None or tail is commrt.NON_GROUP_MEMBER:
        return
    t = torch.full((10,), float(rank))
    commrt.broadcast(t, src=n - 1, group=tail)
    assert_equal(t, torch.full((10,), float(n - 1)), "group broadcast")
    commrt.barrier(group=tail)


def check_p2p(rank: int, n: int) -> None:
    if n == 1:
        return
    right, left = (rank + 1) % n, (rank - 1) % n
    for numel in (0, 3, 600_000):  # 600k float32: several pipelined pieces
        send = values(numel, rank, torch.float32, "SUM", 10)
        got = torch.zeros(numel)
        works = [commrt.isend(send, right, tag=5), commrt.irecv(got, left, tag=5)]
        for w in works:
            w.wait(timeout=60)
        assert_equal(got, values(numel, left, torch.float32, "SUM", 10), f"ring sendrecv n={numel}")
    # tags keep messages apart even when sent in the opposite order to the receives
    if rank == 0:
        works = [commrt.isend(torch.full((2,), 2.0), 1, tag=2), commrt.isend(torch.full((2,), 1.0), 1, tag=1)]
        for w in works:
            w.wait(timeout=60)
    elif rank == 1:
        a, b = torch.zeros(2), torch.zeros(2)
        commrt.recv(a, 0, tag=1)
        commrt.recv(b, 0, tag=2)
        assert a.tolist() == [1.0, 1.0] and b.tolist() == [2.0, 2.0], (a, b)


def check_numpy_and_layout(rank: int, n: int) -> None:
    arr = np.arange(10, dtype=np.float32) + rank
    commrt.all_reduce(arr)  # numpy arrays are updated in place
    np.testing.assert_allclose(arr, sum(np.arange(10, dtype=np.float32) + r for r in range(n)))
    base = torch.arange(24, dtype=torch.float64).view(4, 6) * (rank + 1)
    view = base.t()  # non-contiguous
    commrt.all_reduce(view)
    assert_equal(base, torch.arange(24, dtype=torch.float64).view(4, 6) * sum(range(1, n + 1)), "non-contiguous")
    scalar = torch.tensor(float(rank))
    commrt.all_reduce(scalar, op=commrt.ReduceOp.MAX)
    assert scalar.item() == n - 1
    # one element with stride 2: torch calls it contiguous, yet it cannot be viewed as bytes
    grid = torch.full((4, 2), float(rank))
    commrt.all_reduce(grid[1:2, 1])
    gathered = torch.zeros(n)
    commrt.all_gather_into_tensor(gathered, grid[2:3, 0])
    assert grid[1, 1].item() == sum(range(n)) and grid[0, 0].item() == rank, grid
    assert gathered.tolist() == [float(r) for r in range(n)], gathered


def check_bad_local_input(rank: int, n: int) -> None:
    for call in (lambda: commrt.all_gather_into_tensor(torch.zeros(3 * n + 1), torch.zeros(3)),
                 lambda: commrt.reduce_scatter_tensor(torch.zeros(2), torch.zeros(2 * n + 1)),
                 lambda: commrt.all_reduce(torch.zeros(3, dtype=torch.complex64)),
                 lambda: commrt.all_reduce([1, 2, 3])):
        try:
            call()
        except (ValueError, TypeError, RuntimeError):
            continue
        raise AssertionError("bad input was accepted")
    commrt.barrier()  # and the group still works afterwards


def main() -> None:
    rank, n = init()
    assert commrt.get_backend() in ("zmq", "gloo")
    check_async(rank, n)
    check_independent_groups(rank, n)
    check_groups(rank, n)
    check_p2p(rank, n)
    check_numpy_and_layout(rank, n)
    if commrt.get_backend() == "zmq":
        check_bad_local_input(rank, n)
    commrt.destroy_process_group()
    print(f"rank {rank}: features passed", flush=True)


if __name__ == "__main__":
    main()
