"""The collectives, executed over an OpContext. Each takes flat (1-D, contiguous) tensors.

Large payloads use the ring with a pipeline of pieces: a piece received from the left is
reduced and forwarded right at once, so sending, receiving and reducing overlap and the
whole reduce-scatter + all-gather of an all-reduce flows as one stream. Small payloads use a
direct exchange (one network latency instead of 2(n-1)), reducing in rank order so that every
rank computes bit-identical results.

Buffer rule: ZeroMQ reads large payloads after ``send`` returns, so a buffer that was sent is
not written again until ``ctx.flush()`` (or until causality proves the peer received it).

Aliasing: outputs and inputs are disjoint or in NCCL's in-place form; aliasing.Aliased runs
these functions (and shm_ops.py's) behind the rules that make every other form so.
"""
from __future__ import annotations

from typing import Callable

import torch

from commrt.collectives.algorithms import (chain_order, chunk_bounds, dissemination_steps,
    pairwise_exchange_steps, pieces, ring_all_gather_steps, ring_neighbours, ring_reduce_scatter_steps)
from commrt.collectives.aliasing import own_part
from commrt.collectives.context import OpContext
from commrt.collectives.reduce_ops import (ReduceOp, combine_, combine_into, copy_, finish_avg_,
    reduce_in_order_)

Forward = Callable[[int, int, int, torch.Tensor], torch.Tensor]


def _ring(ctx: OpContext, steps, chunks, first: torch.Tensor, handle: Forward) -> None:
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


def _direct_gather(ctx: OpContext, mine: torch.Tensor, send_to: list[int], recv_from: list[int],
                   numel: int) -> dict[int, torch.Tensor]:
    """Send ``mine`` whole to ``send_to``; return what each of ``recv_from`` sent (unpipelined:
    for small payloads only)."""
    for dst in send_to:
        ctx.send(dst, mine)
    return {src: ctx.recv(src, numel) for src in recv_from}


def _reduce_own_in_order(ctx: OpContext, out: torch.Tensor, own: torch.Tensor, got: dict, op: ReduceOp) -> None:
    """out = the rank-ordered reduction of ``got`` (peer -> frame) and ``own`` (this rank's
    part; it may be ``out`` itself: aliasing.own_part)."""
    own = own_part(own, out, ctx.rank)
    reduce_in_order_(out, [got[p] if p != ctx.rank else own for p in range(ctx.size)], op)


def all_reduce(ctx: OpContext, flat: torch.Tensor, op: ReduceOp) -> None:
    n, numel = ctx.size, flat.numel()
    if n > 1 and numel:
        if numel * ctx.itemsize <= ctx.small_bytes:
            peers = [p for p in range(n) if p != ctx.rank]
            for dst in peers:
                ctx.send(dst, flat)
            got = {src: ctx.recv_buffer(src, numel) for src in peers}
            ctx.flush()  # flat was handed to ZeroMQ: only now may it change
            _reduce_own_in_order(ctx, flat, flat, got, op)
        else:
            chunks = chunk_bounds(numel, n)
            steps = ring_reduce_scatter_steps(ctx.rank, n) + ring_all_gather_steps(ctx.rank, n)
            reducing = n - 1

            def handle(k, a, b, incoming):
                if k < reducing:
                    combine_(flat[a:b], incoming, op)
                else:
                    copy_(flat[a:b], incoming)
                return flat[a:b]
            _ring(ctx, steps, chunks, flat, handle)
    ctx.flush()  # the last pieces may still be on their way out of flat
    if op == ReduceOp.AVG:
        finish_avg_(flat, n)


def reduce_scatter(ctx: OpContext, out: torch.Tensor, inp: torch.Tensor, op: ReduceOp) -> None:
    """``out`` (numel m) gets the reduction of chunk ``rank`` of every rank's ``inp`` (n*m)."""
    n, m = ctx.size, out.numel()
    chunks = [(i * m, (i + 1) * m) for i in range(n)]
    own = chunks[ctx.rank][0]
    if n == 1 or m == 0:
        copy_(out, inp)
    elif n * m * ctx.itemsize <= ctx.small_bytes:
        for dst in range(n):
            if dst != ctx.rank:
                ctx.send(dst, inp[chunks[dst][0]:chunks[dst][1]])
        got = {src: ctx.recv_buffer(src, m) for src in range(n) if src != ctx.rank}
        _reduce_own_in_order(ctx, out, inp[own:own + m], got, op)
    else:
        scratch = torch.empty_like(inp)  # intermediate sums; inp stays untouched
        last = n - 2

        def handle(k, a, b, incoming):
            target = out[a - own:b - own] if k == last else scratch[a:b]
            combine_into(target, inp[a:b], incoming, op)
            return target
        _ring(ctx, ring_reduce_scatter_steps(ctx.rank, n), chunks, inp, handle)
    ctx.flush()
    if op == ReduceOp.AVG:
        finish_avg_(out, n)


def all_gather(ctx: OpContext, out: torch.Tensor, inp: torch.Tensor) -> None:
    """``out`` (n*m) gets every rank's ``inp`` (m) in rank order."""
    n, m = ctx.size, inp.numel()
    chunks = [(i * m, (i + 1) * m) for i in range(n)]
    mine = out[chunks[ctx.rank][0]:chunks[ctx.rank][1]]
    if m and mine.data_ptr() != inp.data_ptr():  # not the in-place form
        copy_(mine, inp)
    if n > 1 and m:
        if n * m * ctx.itemsize <= ctx.small_bytes:
            peers = [p for p in range(n) if p != ctx.rank]
            for src, piece in _direct_gather(ctx, inp, peers, peers, m).items():
                copy_(out[chunks[src][0]:chunks[src][1]], piece)
        else:
            def handle(k, a, b, incoming):
                copy_(out[a:b], incoming)
                return out[a:b]
            _ring(ctx, ring_all_gather_steps(ctx.rank, n), chunks, out, handle)
    ctx.flush()


def broadcast(ctx: OpContext, flat: torch.Tensor, src: int) -> None:
    n, numel = ctx.size, flat.numel()
    if n == 1 or numel == 0:
        return
    if numel * ctx.itemsize <= ctx.small_bytes:
        if ctx.rank == src:
            for dst in range(n):
                if dst != src:
                    ctx.send(dst, flat)
        else:
            copy_(flat, ctx.recv(src, numel))
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


def reduce(ctx: OpContext, flat: torch.Tensor, dst: int, op: ReduceOp) -> None:
    """Only ``dst``'s tensor receives the result; the others are left unchanged."""
    n, numel = ctx.size, flat.numel()
    if n > 1 and numel:
        if numel * ctx.itemsize <= ctx.small_bytes:
            if ctx.rank != dst:
                ctx.send(dst, flat)
            else:
                got = {r: ctx.recv_buffer(r, numel) for r in range(n) if r != dst}
                _reduce_own_in_order(ctx, flat, flat, got, op)
        else:
            _ring_reduce_to(ctx, flat, dst, op)
    ctx.flush()
    if op == ReduceOp.AVG and ctx.rank == dst:
        finish_avg_(flat, n)


def _ring_reduce_to(ctx: OpContext, flat: torch.Tensor, dst: int, op: ReduceOp) -> None:
    """Ring reduce-scatter into scratch, then every rank sends its reduced chunk to ``dst``."""
    n = ctx.size
    chunks = chunk_bounds(flat.numel(), n)
    scratch = torch.empty_like(flat)

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


def all_to_all(ctx: OpContext, out: torch.Tensor, inp: torch.Tensor,
               out_bounds: list[tuple[int, int]], in_bounds: list[tuple[int, int]]) -> None:
    """Block ``in_bounds[j]`` of ``inp`` goes to rank j, landing in its ``out_bounds[rank]``.
    ``out`` and ``inp`` are disjoint (aliasing.all_to_all_source)."""
    lo, hi = in_bounds[ctx.rank]
    olo, ohi = out_bounds[ctx.rank]
    copy_(out[olo:ohi], inp[lo:hi])
    steps = pairwise_exchange_steps(ctx.rank, ctx.size)
    for dst, _ in steps:
        for a, b in pieces(*in_bounds[dst], ctx.piece_elems):
            ctx.send(dst, inp[a:b])
    for _, src in steps:
        for a, b in pieces(*out_bounds[src], ctx.piece_elems):
            copy_(out[a:b], ctx.recv(src, b - a))
    ctx.flush()


def barrier(ctx: OpContext) -> None:
    for dst, src in dissemination_steps(ctx.rank, ctx.size):
        ctx.send(dst)
        ctx.recv(src, 0)
