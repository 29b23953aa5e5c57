"""Every operation of the "commrt" torch backend against what one process computes from all ranks'
inputs (issue 18): reductions (SUM/AVG/PRODUCT/MAX and the bitwise ones), coalesced all_reduce,
all_gather (list, uneven, into-tensor, coalesced), reduce_scatter (list, uneven, tensor),
all_to_all (list, single with uneven splits), reduce, gather, scatter, the *_object helpers,
async handles with futures, send/recv (from one peer and from any), a sparse SUM. Called by tdist_job's peerlost case after init."""
from __future__ import annotations

import torch
import torch.distributed as dist


def x(rank: int, n: int = 6, dtype=torch.float32) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.float64) + 10 * rank + 1).to(dtype)


def reductions(rank: int, world: int) -> None:
    ranks = range(world)
    for op, ref in ((dist.ReduceOp.SUM, sum(x(r) for r in ranks)), (dist.ReduceOp.AVG, sum(x(r) for r in ranks) / world),
                    (dist.ReduceOp.MAX, x(world - 1)), (dist.ReduceOp.PRODUCT, torch.stack([x(r) for r in ranks]).prod(0))):
        t = x(rank)
        dist.all_reduce(t, op=op)
        assert torch.allclose(t, ref), (op, t, ref)
    bits = torch.tensor([rank + 1, 3 << rank], dtype=torch.int64)
    dist.all_reduce(bits, op=dist.ReduceOp.BOR)
    want = [0, 0]
    for r in ranks:
        want = [want[0] | (r + 1), want[1] | (3 << r)]
    assert bits.tolist() == want, bits
    a, b = x(rank), x(rank, 3, torch.float64)
    with dist._coalescing_manager(async_ops=True) as cm:  # -> allreduce_coalesced
        dist.all_reduce(a)
        dist.all_reduce(b)
    cm.wait()
    assert torch.allclose(a, sum(x(r) for r in ranks)) and torch.allclose(b, sum(x(r, 3, torch.float64) for r in ranks))
    t = x(rank)
    dist.reduce(t, dst=world - 1)
    if rank == world - 1:
        assert torch.allclose(t, sum(x(r) for r in ranks))


def gathers(rank: int, world: int) -> None:
    outs = [torch.empty(6) for _ in range(world)]
    dist.all_gather(outs, x(rank))
    assert all(torch.equal(o, x(r)) for r, o in enumerate(outs))
    uneven = [torch.empty(r + 1) for r in range(world)]
    dist.all_gather(uneven, x(rank, rank + 1))
    assert all(torch.equal(o, x(r, r + 1)) for r, o in enumerate(uneven))
    flat = torch.empty(6 * world)
    work = dist.all_gather_into_tensor(flat, x(rank), async_op=True)
    assert torch.equal(work.get_future().wait()[0], torch.cat([x(r) for r in range(world)]))
    g = [torch.empty(6) for _ in range(world)] if rank == 0 else None
    dist.gather(x(rank), g, dst=0)
    if rank == 0:
        assert all(torch.equal(o, x(r)) for r, o in enumerate(g))
    s = torch.empty(2)
    dist.scatter(s, [x(r, 2) for r in range(world)] if rank == 1 else None, src=1)
    assert torch.equal(s, x(rank, 2)), s
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank})
    assert objs == [{"rank": r} for r in range(world)]


def scatters(rank: int, world: int) -> None:
    out = torch.empty(2)
    dist.reduce_scatter(out, [x(rank, 2) + 100 * r for r in range(world)])
    assert torch.allclose(out, sum(x(r, 2) for r in range(world)) + 100 * rank * world), out
    uneven = torch.empty(rank + 1)
    dist.reduce_scatter(uneven, [x(rank, r + 1) for r in range(world)])
    assert torch.allclose(uneven, sum(x(r, rank + 1) for r in range(world))), uneven
    t = torch.empty(3)
    dist.reduce_scatter_tensor(t, torch.cat([x(rank, 3)] * world), op=dist.ReduceOp.AVG)
    assert torch.allclose(t, sum(x(r, 3) for r in range(world)) / world)


def all_to_all(rank: int, world: int) -> None:
    """Rank r sends (d + 1) elements to rank d, valued 100 r + d."""
    ins = [torch.full((d + 1,), 100. * rank + d) for d in range(world)]
    outs = [torch.empty(rank + 1) for _ in range(world)]
    dist.all_to_all(outs, ins)
    assert all(torch.equal(o, torch.full((rank + 1,), 100. * s + rank)) for s, o in enumerate(outs)), outs
    out = torch.empty((rank + 1) * world)
    dist.all_to_all_single(out, torch.cat(ins), [rank + 1] * world, [d + 1 for d in range(world)])
    assert torch.equal(out, torch.cat(outs))


def sparse(rank: int, world: int) -> None:
    """Rank r holds r + 1 non-zeros of a 5 x 3 matrix (rows overlap across ranks, one row empty
    on rank 0): the sum equals the dense sum of every rank's matrix."""
    def mine(r):
        rows = torch.tensor([(r + k) % 5 for k in range(r + 1)])
        return torch.sparse_coo_tensor(torch.stack([rows, rows % 3]), x(r, r + 1), (5, 3))
    t = mine(rank)
    dist.all_reduce(t)
    assert t.is_sparse and torch.equal(t.to_dense(), sum(mine(r).to_dense() for r in range(world))), t
    w = dist.all_reduce(mine(rank).coalesce(), async_op=True)
    w.wait()


def point_to_point(rank: int, world: int) -> None:
    """Every rank sends x(rank) to rank 0, which takes them from any source (torch's
    recv_anysource) and by rank; dist.recv returns who sent each."""
    if rank:
        dist.send(x(rank), 0, tag=7)
        dist.send(x(rank) * 2, 0, tag=8)
        return
    got = {}
    for _ in range(world - 1):
        t = torch.empty(6)
        src = dist.recv(t, tag=7)
        got[src] = t
    assert sorted(got) == list(range(1, world)) and all(torch.equal(t, x(r)) for r, t in got.items()), got
    for r in range(1, world):
        t = torch.empty(6)
        assert dist.recv(t, r, tag=8) == r and torch.equal(t, x(r) * 2)


def bools(rank: int, world: int) -> None:
    """torch's bool contract (issue 30 item 6): SUM/MAX are OR, PRODUCT/MIN are AND, bytes stay
    0 or 1 (a byte sum was [2, 2, 0] at 2 ranks), bool and uint8 coalesced keep their own ops."""
    mine = torch.tensor([True, rank == 0, False, True])
    for op, want in ((dist.ReduceOp.SUM, [1, 1, 0, 1]), (dist.ReduceOp.MAX, [1, 1, 0, 1]),
                     (dist.ReduceOp.PRODUCT, [1, 0, 0, 1]), (dist.ReduceOp.MIN, [1, 0, 0, 1])):
        for async_op in (False, True):
            t = mine.clone()
            work = dist.all_reduce(t, op=op, async_op=async_op)
            if work is not None:
                work.wait()
            assert t.view(torch.uint8).tolist() == want, (op, async_op, t.view(torch.uint8))
    flags, counts = mine.clone(), torch.ones(4, dtype=torch.uint8)
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.all_reduce(flags)
        dist.all_reduce(counts)
    cm.wait()
    assert flags.view(torch.uint8).tolist() == [1, 1, 0, 1] and counts.tolist() == [world] * 4, (flags, counts)
    out = torch.empty(2, dtype=torch.bool)
    dist.reduce_scatter_tensor(out, mine[:2].repeat(world))
    assert out.view(torch.uint8).tolist() == [1, 1], out.view(torch.uint8)
    try:
        dist.all_reduce(mine.clone(), op=dist.ReduceOp.AVG)
    except ValueError as e:
        assert "AVG is not defined for bool" in str(e), e
    else:
        raise AssertionError("AVG on bool was accepted")


def check_all(rank: int, world: int) -> None:
    reductions(rank, world)
    bools(rank, world)
    gathers(rank, world)
    scatters(rank, world)
    all_to_all(rank, world)
    sparse(rank, world)
    point_to_point(rank, world)
    print(f"OK ops rank {rank}", flush=True)
