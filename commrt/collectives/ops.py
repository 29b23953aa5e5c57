"""The collectives, executed over an OpContext. Each takes flat (1-D, contiguous) tensors.

Which schedule runs is the selection table's choice (selection.py, ``[comm] algorithms``), by
collective, size and world size. Latency-optimal schedules (recursive doubling, Rabenseifner,
binomial trees, Bruck, pairwise exchange, dissemination) are data from schedules.py, run by
scheduled.py: log2 n messages per rank where the old direct exchange sent n-1. The ring, the
bandwidth-optimal choice for large payloads, runs here with a pipeline of pieces: a piece
received from the left is reduced and forwarded right at once, so sending, receiving and
reducing overlap and the whole reduce-scatter + all-gather of an all-reduce flows as one stream.
reduce_scatter keeps a direct exchange up to small_bytes (it is not in the table yet).
Every schedule reduces so that all ranks compute bit-identical results.

An empty buffer still runs its schedule, of empty messages (the ring's as steps; reduce_scatter
its direct exchange): a rank that skipped an op its peers run with elements let them wait for
it until the deadline, then blamed it as lost, instead of the mismatch its header shows.

Buffer rule: ZeroMQ reads large payloads after ``send`` returns, so a buffer that was sent is
not written again until ``ctx.flush()`` (or until causality proves the peer received it).

Aliasing: outputs and inputs are disjoint or in NCCL's in-place form; aliasing.Aliased runs
these functions (and shm_ops.py's) behind the rules that make every other form so.
"""
from __future__ import annotations

import functools
from typing import Callable

import numpy as np

from commrt.collectives.algorithms import (chain_order, chunk_bounds, pieces, ring_all_gather_steps,
    ring_neighbours, ring_reduce_scatter_steps)
from commrt.collectives.aliasing import own_part
from commrt.runtime.arrays import address, empty_like, numel as numel_of
from commrt.collectives.context import OpContext
from commrt.collectives.scheduled import Side, run
from commrt.collectives.schedules import ALGORITHMS, REDUCE, Step
from commrt.collectives.reduce_ops import (ReduceOp, avg_part, combine_, combine_into, copy_, finish_avg_,
    reduce_in_order_)

Forward = Callable  # (k, a, b, incoming piece) -> what to forward


def _ring(ctx: OpContext, steps, chunks, first, handle: Forward) -> None:
    """Run ring ``steps`` (send chunk, recv chunk) piece by piece.

    ``first`` is the buffer the step-0 chunk is sent from; ``handle(k, a, b, incoming)``
    consumes piece [a, b) received at step k and returns what to forward at step k+1 (the
    chunk received at step k is always the chunk sent at step k+1).
    """
    left, right = ring_neighbours(ctx.rank, ctx.size)
    pe = ctx.piece_elems
    for a, b in pieces(*chunks[steps[0][0]], pe):
        ctx.send(right, first[a:b])
    last = len(steps) - 1
    for k, (_, recv_chunk) in enumerate(steps):
        for a, b in pieces(*chunks[recv_chunk], pe):
            out = handle(k, a, b, ctx.recv(left, b - a))
            if k < last:
                ctx.send(right, out)


@functools.lru_cache(maxsize=256)
def _steps(collective: str, algorithm: str, rank: int, n: int, root: int) -> tuple[tuple[Step, ...], int]:
    """One rank's steps and the schedule's chunk count (cached: programs repeat their ops)."""
    build, parts = ALGORITHMS[collective][algorithm]
    return tuple(build(rank, n, root, 1)), parts(n, 1)


def _scheduled(ctx: OpContext, collective: str, algorithm: str, buf,
               op: ReduceOp | None = None, root: int = 0) -> None:
    """Run a schedule over one buffer cut into the schedule's chunks (scheduled.run)."""
    steps, parts = _steps(collective, algorithm, ctx.rank, ctx.size, root)
    run(ctx, list(steps), Side(buf, chunk_bounds(numel_of(buf), parts)), op=op)


def _reduce_own_in_order(ctx: OpContext, out, own, got: dict, op: ReduceOp) -> None:
    """out = the rank-ordered reduction of ``got`` (peer -> frame) and ``own`` (this rank's
    part; it may be ``out`` itself: aliasing.own_part)."""
    own = own_part(own, out, ctx.rank)
    reduce_in_order_(out, [got[p] if p != ctx.rank else own for p in range(ctx.size)], op)


def all_reduce(ctx: OpContext, flat, op: ReduceOp) -> None:
    n, numel = ctx.size, numel_of(flat)
    if n > 1:
        avg_part(flat, op, n)  # a half-precision AVG divides first (reduce_ops.divides_first)
        algorithm = ctx.algorithm("all_reduce", numel * ctx.itemsize)
        if algorithm == "ring" and numel:
            _ring_all_reduce(ctx, flat, op)
        else:
            _scheduled(ctx, "all_reduce", algorithm, flat, op)
    ctx.flush()  # the last pieces may still be on their way out of flat
    if op == ReduceOp.AVG:
        finish_avg_(flat, n)


def _ring_all_reduce(ctx: OpContext, flat, op: ReduceOp) -> None:
    n = ctx.size
    chunks = chunk_bounds(numel_of(flat), n)
    steps = ring_reduce_scatter_steps(ctx.rank, n) + ring_all_gather_steps(ctx.rank, n)
    reducing = n - 1

    def handle(k, a, b, incoming):
        if k < reducing:
            combine_(flat[a:b], incoming, op)
        else:
            copy_(flat[a:b], incoming)
        return flat[a:b]
    _ring(ctx, steps, chunks, flat, handle)


def reduce_scatter(ctx: OpContext, out, inp, op: ReduceOp) -> None:
    """``out`` (numel m) gets the reduction of chunk ``rank`` of every rank's ``inp`` (n*m)."""
    n, m = ctx.size, numel_of(out)
    chunks = [(i * m, (i + 1) * m) for i in range(n)]
    own = chunks[ctx.rank][0]
    inp = avg_part(inp, op, n, copy=True)  # the caller's input stays as it was
    if n == 1:
        copy_(out, inp)
    elif n * m * ctx.itemsize <= ctx.small_bytes:
        for dst in range(n):
            if dst != ctx.rank:
                ctx.send(dst, inp[chunks[dst][0]:chunks[dst][1]])
        got = {src: ctx.recv_buffer(src, m) for src in range(n) if src != ctx.rank}
        if m:  # (torch cannot view an empty frame)
            _reduce_own_in_order(ctx, out, inp[own:own + m], got, op)
    else:
        scratch = empty_like(inp)  # intermediate sums; inp stays untouched
        last = n - 2

        def handle(k, a, b, incoming):
            target = out[a - own:b - own] if k == last else scratch[a:b]
            combine_into(target, inp[a:b], incoming, op)
            return target
        _ring(ctx, ring_reduce_scatter_steps(ctx.rank, n), chunks, inp, handle)
    ctx.flush()
    if op == ReduceOp.AVG:
        finish_avg_(out, n)


def all_gather(ctx: OpContext, out, inp) -> None:
    """``out`` (n*m) gets every rank's ``inp`` (m) in rank order."""
    n, m = ctx.size, numel_of(inp)
    chunks = [(i * m, (i + 1) * m) for i in range(n)]
    mine = out[chunks[ctx.rank][0]:chunks[ctx.rank][1]]
    if m and address(mine) != address(inp):  # not the in-place form
        copy_(mine, inp)
    if n > 1:
        algorithm = ctx.algorithm("all_gather", n * m * ctx.itemsize)
        if algorithm == "ring" and m:
            def handle(k, a, b, incoming):
                copy_(out[a:b], incoming)
                return out[a:b]
            _ring(ctx, ring_all_gather_steps(ctx.rank, n), chunks, out, handle)
        else:  # Bruck: chunk i of out is rank i's block, as chunk_bounds(n*m, n) cuts it
            _scheduled(ctx, "all_gather", algorithm, out)
    ctx.flush()


def _agree_on_root(ctx: OpContext) -> None:
    """One empty message to the right neighbour, one from the left, before a rooted op: its
    header carries the root, so ranks that disagree about it raise CollectiveMismatch at once
    (if the roots differ anywhere, they differ between some pair of neighbours). Without it,
    ranks that each took another for the root each waited for its parent for the whole
    deadline and then blamed a live rank (2 ranks calling broadcast(src=1 - rank)); shared
    memory compares every rank's header already. Costs one small message's latency."""
    left, right = ring_neighbours(ctx.rank, ctx.size)
    ctx.send(right)
    ctx.recv(left)


def broadcast(ctx: OpContext, flat, src: int) -> None:
    n, numel = ctx.size, numel_of(flat)
    if n == 1:
        return
    _agree_on_root(ctx)
    algorithm = ctx.algorithm("broadcast", numel * ctx.itemsize)
    if algorithm != "chain" or not numel:
        _scheduled(ctx, "broadcast", algorithm, flat, root=src)
    else:
        chain = chain_order(src, n)
        pos = chain.index(ctx.rank)
        prev = chain[pos - 1] if pos else None
        nxt = chain[pos + 1] if pos + 1 < n else None
        for a, b in pieces(0, numel, ctx.piece_elems):
            if prev is not None:
                copy_(flat[a:b], ctx.recv(prev, b - a))
            if nxt is not None:
                ctx.send(nxt, flat[a:b])
    ctx.flush()


def reduce(ctx: OpContext, flat, dst: int, op: ReduceOp) -> None:
    """Only ``dst``'s tensor receives the result; the others are left unchanged."""
    n, numel = ctx.size, numel_of(flat)
    if n > 1:
        _agree_on_root(ctx)
        mine = avg_part(flat, op, n, copy=ctx.rank != dst)  # another rank's tensor stays as it was
        algorithm = ctx.algorithm("reduce", numel * ctx.itemsize)
        if algorithm == "ring" and numel:
            _ring_reduce_to(ctx, mine, dst, op)
        else:
            steps, _ = _steps("reduce", algorithm, ctx.rank, n, dst)
            reduces = any(s.action == REDUCE for s in steps)
            buf = mine
            if ctx.rank != dst and reduces and mine is flat:  # an inner node sums into scratch
                buf = empty_like(flat)
                copy_(buf, flat)
            _scheduled(ctx, "reduce", algorithm, buf, op, root=dst)
            ctx.flush()  # buf may still be read by ZeroMQ: flush while it is alive
    ctx.flush()
    if op == ReduceOp.AVG and ctx.rank == dst:
        finish_avg_(flat, n)


def _ring_reduce_to(ctx: OpContext, flat, dst: int, op: ReduceOp) -> None:
    """Ring reduce-scatter into scratch, then every rank sends its reduced chunk to ``dst``."""
    n = ctx.size
    chunks = chunk_bounds(numel_of(flat), n)
    scratch = empty_like(flat)

    def handle(k, a, b, incoming):
        combine_into(scratch[a:b], flat[a:b], incoming, op)
        return scratch[a:b]
    _ring(ctx, ring_reduce_scatter_steps(ctx.rank, n), chunks, flat, handle)
    lo, hi = chunks[ctx.rank]
    if ctx.rank != dst:
        for a, b in pieces(lo, hi, ctx.piece_elems):
            ctx.send(dst, scratch[a:b])
        return
    for src in range(n):
        for a, b in pieces(*chunks[src], ctx.piece_elems):
            copy_(flat[a:b], scratch[a:b] if src == dst else ctx.recv(src, b - a))


def all_to_all(ctx: OpContext, out, inp,
               out_bounds: list[tuple[int, int]], in_bounds: list[tuple[int, int]]) -> None:
    """Block ``in_bounds[j]`` of ``inp`` goes to rank j, landing in its ``out_bounds[rank]``.
    ``out`` and ``inp`` are disjoint (aliasing.all_to_all_source). Pairwise exchange: sends
    read only the input, so all are queued before the receives (scheduled.run's sends_first)."""
    lo, hi = in_bounds[ctx.rank]
    olo, ohi = out_bounds[ctx.rank]
    copy_(out[olo:ohi], inp[lo:hi])
    nbytes = (in_bounds[-1][1] - in_bounds[0][0]) * ctx.itemsize if in_bounds else 0
    steps, _ = _steps("all_to_all", ctx.algorithm("all_to_all", nbytes), ctx.rank, ctx.size, 0)
    ctx.blocks = ([b - a for a, b in in_bounds], [b - a for a, b in out_bounds])  # in every piece's header
    run(ctx, list(steps), Side(inp, in_bounds), Side(out, out_bounds), sends_first=True)
    ctx.flush()


_NOTHING = np.empty(0, np.uint8)


def barrier(ctx: OpContext) -> None:
    """Dissemination: ceil(log2 n) rounds of one empty message each way."""
    steps, _ = _steps("barrier", ctx.algorithm("barrier", 0), ctx.rank, ctx.size, 0)
    run(ctx, list(steps), Side(_NOTHING, [(0, 0)]))
