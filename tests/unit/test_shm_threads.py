"""The shared-memory collectives (collectives/shm_ops.py) at worlds that are not powers of two,
without processes: one thread per rank, each with its own Channel over the same segments (as
each process maps them). Every op against the single-process reference, in place and out of
place, across the one-step and rounds paths (small slots: many rounds), floats bit-identical on
every rank; all_to_all block lengths that disagree are one CollectiveMismatch on every rank.
tests/multirank/test_shm.py runs the same path over real processes at 2-4 ranks."""
import threading

import numpy as np
import pytest
import torch

from commrt.collectives import shm_ops
from commrt.collectives.aliasing import Aliased
from commrt.collectives.context import Coll
from commrt.collectives.reduce_ops import ReduceOp
from commrt.runtime.errors import CollectiveMismatch
from commrt.transport import shm
from tests.unit.test_shm_fastpath import _Ep

SLOT = 4096  # bytes: 1,024 float32 a step, so the larger sizes take several rounds
OPS = Aliased(shm_ops)


@pytest.fixture(params=[5, 7])
def world(request):
    n = request.param
    made = [shm.create(SLOT) for _ in range(n)]
    chans = [shm.Channel(_Ep(r, n), [mm for _, mm in made], [str(p) for p in range(n)], SLOT, 1.0) for r in range(n)]
    for c in chans:  # threads of one process: a rank spinning on sched_yield holds back the others
        c._yield_s = 0.0
    yield chans
    for c in chans:
        c.close()
    for fd, _ in made:
        shm.close_fd(fd)


def run(chans, body):
    """``body(rank, channel)`` on one thread per rank; each rank's result or exception."""
    out = [None] * len(chans)

    def one(r):
        try:
            out[r] = body(r, chans[r])
        except Exception as exc:  # noqa: BLE001 (returned to the test)
            out[r] = exc
    threads = [threading.Thread(target=one, args=(r,)) for r in range(len(chans))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a rank did not finish"
    return out


def ctx(chan, r, n, coll, dtype, count, op=0, root=0):
    return shm_ops.ShmContext(chan, 0, r, n, 1, coll, dtype, count, 0, int(op), root, 2048)


def values(numel, r, dtype, op):
    g = np.random.default_rng(numel * 31 + r)
    if dtype.is_floating_point and op == ReduceOp.SUM:
        return torch.from_numpy(g.standard_normal(numel)).to(dtype)
    return torch.from_numpy(g.choice([1, 2] if op == ReduceOp.PRODUCT else range(-5, 6), size=numel)).to(dtype)


def reference(parts, op):
    w = torch.stack([p.double() for p in parts])
    r = {ReduceOp.SUM: w.sum(0), ReduceOp.PRODUCT: w.prod(0), ReduceOp.MIN: w.min(0).values,
         ReduceOp.MAX: w.max(0).values}[op]
    return r


def close(got, want):
    if not got.dtype.is_floating_point:  # int8 wraps, as the reference cast back does
        return torch.equal(got, want.long().to(got.dtype))
    tol = {torch.float32: 1e-5, torch.bfloat16: 0.1}[got.dtype]
    return got.numel() == 0 or (got.double() - want).abs().max().item() <= tol * max(1.0, want.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_every_op_equals_the_reference_bit_identical_on_every_rank(world, dtype):
    n = len(world)
    for op in (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX):
        for numel in (0, 1, n + 1, 300, 3001):  # empty, one step, and rounds
            parts = [values(numel, r, dtype, op) for r in range(n)]
            shards = [p[:numel // n * n] for p in parts]
            m = numel // n

            def body(r, ch):
                t = parts[r].clone()
                OPS.all_reduce(ctx(ch, r, n, Coll.ALL_REDUCE, dtype, numel, op), t, op)
                u = parts[r].clone()
                OPS.reduce(ctx(ch, r, n, Coll.REDUCE, dtype, numel, op, n - 2), u, n - 2, op)
                b = parts[r].clone()
                OPS.broadcast(ctx(ch, r, n, Coll.BROADCAST, dtype, numel, root=1), b, 1)
                s = shards[r].clone()  # reduce_scatter in place: the output is the input's own slice
                OPS.reduce_scatter(ctx(ch, r, n, Coll.REDUCE_SCATTER, dtype, m * n, op), s[r * m:(r + 1) * m], s, op)
                g = torch.zeros(m * n, dtype=dtype)
                OPS.all_gather(ctx(ch, r, n, Coll.ALL_GATHER, dtype, m * n), g, shards[r][:m])
                return t, u, b, s[r * m:(r + 1) * m], g
            got = run(world, body)
            want, what = reference(parts, op), (n, dtype, op.name, numel)
            for r, (t, u, b, s, g) in enumerate(got):
                assert close(t, want) and torch.equal(t.view(-1), got[0][0].view(-1)), what
                assert close(u, want) if r == n - 2 else torch.equal(u, parts[r]), what
                assert torch.equal(b, parts[1]), what
                assert close(s, reference(shards, op)[r * m:(r + 1) * m]), what
                assert torch.equal(g, torch.cat([q[:m] for q in shards])), what


def _a2a(chans, sizes):
    """Rank r sends sizes(r, j) elements to rank j; returns each rank's output (or error)."""
    n = len(chans)
    bounds = lambda s: [(sum(s[:i]), sum(s[:i + 1])) for i in range(n)]  # noqa: E731

    def body(r, ch):
        sent = [sizes(r, j) for j in range(n)]
        expected = [sizes(j, r) if (j, r) != (1, 0) else sizes.expected_1_0 for j in range(n)]
        inp = torch.cat([torch.arange(k, dtype=torch.float32) + 100 * r + 1000 * j for j, k in enumerate(sent)])
        out = torch.full((sum(expected),), -1.0)
        OPS.all_to_all(ctx(ch, r, n, Coll.ALL_TO_ALL, torch.float32, 0), out, inp, bounds(expected), bounds(sent))
        return out
    return run(chans, body)


def test_all_to_all_uneven_and_lengths_that_disagree(world):
    n = len(world)

    class Sizes:
        def __init__(self, expected_1_0):
            self.expected_1_0 = expected_1_0

        def __call__(self, r, j):
            return (r * 7 + j * 3) % 5 * 300  # 0 to 1,200 elements: up to 5 rounds of 204
    for r, out in enumerate(_a2a(world, Sizes(Sizes(0)(1, 0)))):
        want = [torch.arange(Sizes(0)(j, r), dtype=torch.float32) + 100 * j + 1000 * r for j in range(n)]
        assert torch.equal(out, torch.cat(want)), r
    # rank 0 expects one element more from rank 1 than rank 1 sends: it read a stale element before
    sent = Sizes(0)(1, 0)
    errors = _a2a(world, Sizes(sent + 1))
    assert all(isinstance(e, CollectiveMismatch) for e in errors), errors
    assert all((e.rank, e.peer) == (0, 1) and f"expects from rank 1={sent + 1}" in str(e)
               and f"sends to rank 0={sent}" in str(e) for e in errors), errors[0]
