"""The collectives over shared memory (transport/shm.py), for a group whose ranks share a node.
Same signatures as ops.py; ``ctx`` is a ShmContext (shm_context.py).

A step (ShmContext.begin, then exchange) writes this rank's part into its slot, waits until every
peer has published the same step, and then reads the peers' slots in place: data is copied once
into shared memory and consumed from there straight into the output, never staged again.
all_reduce of a small payload (up to ``[comm] small_bytes``, and while its n - 1 peers' copies
together stay under ONE_STEP_PEER_BYTES) is one step in which every rank reduces all parts in
rank order; a larger one runs rounds of two steps as DeepSpeed's CPU all-reduce does: each rank
reduces its 1/n of the round straight from the peers' slots, then everyone copies the n
reduced parts out. Every element is reduced by one rank (or by all in the same order), so
results are bit-identical across ranks. Outputs and inputs are disjoint or in the in-place
form: aliasing.Aliased runs these, as it runs ops.py's.
"""
from __future__ import annotations

import numpy as np

from commrt.runtime.arrays import address, as_numpy, numel as numel_of
from commrt.runtime.errors import CollectiveMismatch, ProtocolError
from commrt.collectives.algorithms import chunk_bounds
from commrt.collectives.aliasing import own_part
from commrt.collectives.contract import describe as _describe
from commrt.collectives.reduce_ops import (ReduceOp, avg_part, copy_, finish_avg_, reduce_arrays_, reduce_in_order_,
                                           reduce_rows_)
from commrt.collectives.shm_context import ShmContext

# the one-step all_reduce has every rank read every peer's payload, freshly written by another
# core; the rounds read 2/n of it in two steps. On 16 cores at 8 ranks (docs/PERFORMANCE.md, "On
# 16 cores") one step won at 4 and 16 KiB (44 / 53 us against 74-79), the rounds at 64 KiB (83-91
# against 96-126): one step while the peers' payloads together stay under this
ONE_STEP_PEER_BYTES = 224 << 10
WHOLE_COPY_BYTES = 256 << 10  # below this, one copy of a round's part costs less than n - 1 calls
MAX_AUX = 1 << 48  # a peer's all_to_all block length beyond this is garbage, not a size
# from this many ranks the one-step all-reduce reduces every rank's row in one numpy call; below,
# a call per part costs as little or less (4 KiB of float32, us, per part / rows: 2 ranks 2.6 /
# 2.8, 3 ranks 2.7-3.4 / 2.9-3.5, 4 ranks 3.8 / 3.0, 8 ranks 8.3 / 3.7, 16 ranks 17.7 / 5.8;
# `python -m tests.perf.shm_peer_cost`, docs/PERFORMANCE.md "The small all_reduce's own cost")
ROWS_REDUCE_FROM = 4
AVG = ReduceOp.AVG  # a module constant: the enum's attribute costs more than the comparison


def _rounds(total: int, per: int):
    for a in range(0, total, per):
        yield a, min(a + per, total)


def all_reduce(ctx: ShmContext, flat, op: ReduceOp) -> None:
    n, numel = ctx.size, numel_of(flat)
    if n > 1 and numel:
        if op == AVG:
            avg_part(flat, op, n)  # a half-precision AVG divides first (reduce_ops.divides_first)
        nbytes = numel * ctx.itemsize
        small = nbytes <= min(ctx.small_bytes, ctx.chan.slot_bytes) and nbytes * (n - 1) <= ONE_STEP_PEER_BYTES
        if small:
            _all_reduce_one_step(ctx, flat, numel, op)
        else:
            per = max(n, ctx.slot_elems // n * n)
            if ctx.np_dtype is not None:
                out = as_numpy(flat)
                for a, b in _rounds(numel, per):
                    _all_reduce_round_np(ctx, out[a:b], op)
            else:
                for a, b in _rounds(numel, per):
                    _all_reduce_round(ctx, flat[a:b], op)
    elif n > 1:  # empty: one step of headers, so a peer with elements sees the mismatch (ops.py)
        barrier(ctx)
    if op == AVG:
        finish_avg_(flat, n)


def _all_reduce_one_step(ctx: ShmContext, flat, numel: int, op: ReduceOp) -> None:
    """A small payload in one step: every rank reduces all parts in rank order. Each rank
    writes its part as a row beside the others' (Channel.rows), and the reduction is one numpy
    call over the rows: at 4 KiB a call costs about as much as its sum, so one per peer made
    the op's cost grow with the ranks (docs/PERFORMANCE.md, small collectives). A single
    element, a dtype numpy lacks (bfloat16) or rows too long for a slot take the parts from
    each rank's own slot (the same order, so the same result)."""
    slot = ctx.begin()
    got = ctx.chan.rows(ctx.np_dtype, numel, slot) if ctx.np_dtype is not None and numel > 1 else None
    if got is not None:
        every, parts = got
        out = as_numpy(flat)
        parts[ctx.rank][...] = out
        ctx.sent_to_all(numel)
        ctx.exchange()
        if ctx.size < ROWS_REDUCE_FROM:
            reduce_arrays_(out, parts, op)
        else:
            reduce_rows_(out, every, op)
        return
    copy_(ctx.view(ctx.rank, slot, 0, numel), flat)
    ctx.sent_to_all(numel)
    ctx.exchange()
    reduce_in_order_(flat, [ctx.view(p, slot, 0, numel) for p in range(ctx.size)], op)


def _all_reduce_round_np(ctx: ShmContext, part: np.ndarray, op: ReduceOp) -> None:
    """_all_reduce_round over numpy views of the slots (made once per dtype). A part up to
    WHOLE_COPY_BYTES goes into this rank's slot in one copy (its own slice too, which nobody
    reads: one call instead of n - 1). Each rank's slice is reduced in rank order, as in the
    one-step path and _all_reduce_round, so the three give equal results."""
    n, me, numel = ctx.size, ctx.rank, part.size
    bounds = chunk_bounds(numel, n)
    slots = ctx.chan.slots(ctx.np_dtype)
    slot, whole = ctx.begin(), numel * ctx.itemsize <= WHOLE_COPY_BYTES
    mine = slots[me][slot]
    if whole:
        np.copyto(mine[:numel], part)
    for p, (lo, hi) in enumerate(bounds):
        if p != me:
            if not whole:
                np.copyto(mine[lo:hi], part[lo:hi])
            ctx.sent(p, hi - lo + bounds[me][1] - bounds[me][0])  # its slice now, our result next
    ctx.exchange()
    lo, hi = bounds[me]
    result = ctx.begin()  # the next step's slot: free once every peer reached this one
    reduce_arrays_(slots[me][result][lo:hi], [part[lo:hi] if p == me else slots[p][slot][lo:hi] for p in range(n)],
                   op)
    ctx.exchange()
    for p, (lo, hi) in enumerate(bounds):
        np.copyto(part[lo:hi], slots[p][result][lo:hi])


def _all_reduce_round(ctx: ShmContext, part, op: ReduceOp) -> None:
    """Each rank publishes the slices its peers reduce (its own it reads in place), reduces
    its slice into its next slot, then copies every rank's reduced slice out."""
    n, me = ctx.size, ctx.rank
    bounds = chunk_bounds(numel_of(part), n)
    slot = ctx.begin()
    for p, (lo, hi) in enumerate(bounds):
        if p != me:
            copy_(ctx.view(me, slot, lo, hi - lo), part[lo:hi])
            ctx.sent(p, hi - lo + bounds[me][1] - bounds[me][0])  # its slice now, our result next
    ctx.exchange()
    lo, hi = bounds[me]
    result = ctx.begin()  # the next step's slot: free once every peer reached this one
    reduce_in_order_(ctx.view(me, result, lo, hi - lo),
                     [part[lo:hi] if p == me else ctx.view(p, slot, lo, hi - lo) for p in range(n)], op)
    ctx.exchange()
    for p, (lo, hi) in enumerate(bounds):
        copy_(part[lo:hi], ctx.view(p, result, lo, hi - lo))


def reduce_scatter(ctx: ShmContext, out, inp, op: ReduceOp) -> None:
    n, m, me = ctx.size, numel_of(out), ctx.rank
    if n == 1 or m == 0:
        copy_(out, inp)
        if n > 1:  # empty: one step of headers (all_reduce)
            barrier(ctx)
    else:
        inp = avg_part(inp, op, n, copy=True)  # the caller's input stays as it was
        w = max(1, ctx.slot_elems // n)
        for x, y in _rounds(m, w):
            slot = ctx.begin()
            for j in range(n):
                if j != me:  # our own block is read in place
                    copy_(ctx.view(me, slot, j * w, y - x), inp[j * m + x:j * m + y])
                    ctx.sent(j, y - x)
            ctx.exchange()
            own = own_part(inp[me * m + x:me * m + y], out[x:y], me)
            reduce_in_order_(out[x:y], [own if p == me else ctx.view(p, slot, me * w, y - x)
                                        for p in range(n)], op)
    if op == ReduceOp.AVG:
        finish_avg_(out, n)


def all_gather(ctx: ShmContext, out, inp) -> None:
    n, m, me = ctx.size, numel_of(inp), ctx.rank
    mine = out[me * m:(me + 1) * m]
    in_place = m and address(mine) == address(inp)
    if n == 1 or m == 0:
        copy_(mine, inp)
        if n > 1:  # empty: one step of headers (all_reduce)
            barrier(ctx)
        return
    for x, y in _rounds(m, ctx.slot_elems):
        slot = ctx.begin()
        copy_(ctx.view(me, slot, 0, y - x), inp[x:y])
        ctx.sent_to_all(y - x)
        ctx.exchange()
        for p in range(n):
            if p != me:
                copy_(out[p * m + x:p * m + y], ctx.view(p, slot, 0, y - x))
    if not in_place:
        copy_(mine, inp)


def broadcast(ctx: ShmContext, flat, src: int) -> None:
    if ctx.size == 1:
        return
    for a, b in _rounds(numel_of(flat), ctx.slot_elems) if numel_of(flat) else [(0, 0)]:
        slot = ctx.begin()
        if ctx.rank == src:
            copy_(ctx.view(src, slot, 0, b - a), flat[a:b])
            for p in range(ctx.size):
                if p != src:
                    ctx.sent(p, b - a)
        ctx.exchange()
        if ctx.rank != src:
            copy_(flat[a:b], ctx.view(src, slot, 0, b - a))


def reduce(ctx: ShmContext, flat, dst: int, op: ReduceOp) -> None:
    n, me = ctx.size, ctx.rank
    if n > 1:
        mine = avg_part(flat, op, n, copy=me != dst)  # another rank's tensor stays as it was
        for a, b in _rounds(numel_of(flat), ctx.slot_elems) if numel_of(flat) else [(0, 0)]:
            slot = ctx.begin()
            if me != dst:
                copy_(ctx.view(me, slot, 0, b - a), mine[a:b])
                ctx.sent(dst, b - a)
            ctx.exchange()
            if me == dst and b > a:
                own = own_part(flat[a:b], flat[a:b], dst)
                parts = [own if p == dst else ctx.view(p, slot, 0, b - a) for p in range(n)]
                reduce_in_order_(flat[a:b], parts, op)
    if op == ReduceOp.AVG and me == dst:
        finish_avg_(flat, n)


def all_to_all(ctx: ShmContext, out, inp,
               out_bounds: list[tuple[int, int]], in_bounds: list[tuple[int, int]]) -> None:
    """Blocks move in rounds of ``w`` elements per destination; the first step also publishes
    every rank's block lengths (``_blocks``), so ranks that disagree about a block's length
    fail alike instead of reading a truncated or stale block, and the number of rounds comes
    from the longest block any rank sends or receives."""
    n, me = ctx.size, ctx.rank
    copy_(out[out_bounds[me][0]:out_bounds[me][1]], inp[in_bounds[me][0]:in_bounds[me][1]])
    w = max(1, (ctx.chan.slot_bytes - _table_bytes(n)) // ctx.itemsize // n)
    rounds, r = 1, 0
    while r < rounds:
        slot = ctx.begin()
        if r == 0:
            _blocks(ctx, me, slot)[:] = [hi - lo for lo, hi in [*in_bounds, *out_bounds]]
        for j, (lo, hi) in enumerate(in_bounds):
            a, b = min(hi, lo + r * w), min(hi, lo + (r + 1) * w)
            if j != me and b > a:
                copy_(ctx.view(me, slot, j * w, b - a), inp[a:b])
                ctx.sent(j, b - a)
        ctx.exchange()
        if r == 0:
            rounds = max(1, -(-_check_blocks(ctx, slot) // w))
        for p, (lo, hi) in enumerate(out_bounds):
            a, b = min(hi, lo + r * w), min(hi, lo + (r + 1) * w)
            if p != me and b > a:
                copy_(out[a:b], ctx.view(p, slot, me * w, b - a))
        r += 1


def _table_bytes(n: int) -> int:
    return 16 * n  # per rank: n lengths sent, n expected, as int64


def _blocks(ctx: ShmContext, p: int, slot: int) -> np.ndarray:
    """Rank p's all_to_all block lengths in ``slot``: the n it sends (to rank 0, 1, ...), then
    the n it expects (from rank 0, 1, ...); the last words of the slot, past the blocks."""
    end = (slot + 1) * ctx.chan.slot_bytes
    return ctx.chan.raw[p][end - _table_bytes(ctx.size):end].view(np.int64)


def _check_blocks(ctx: ShmContext, slot: int) -> int:
    """Every rank reads the whole table, so all raise the same error: the first pair (p, q) where
    p sends q another length than q expects (the TCP path sees the same as a piece's size).
    Returns the longest block."""
    n = ctx.size
    table = np.stack([_blocks(ctx, p, slot) for p in range(n)])
    if table.min() < 0 or table.max() > MAX_AUX:
        p = int(np.argwhere((table < 0) | (table > MAX_AUX))[0][0])
        raise ProtocolError(f"rank {ctx.rank}, all_to_all (seq {ctx.seq}): rank {p} published an "
                            f"impossible block length")
    sends, expects = table[:, :n], table[:, n:]
    bad = np.argwhere(sends != expects.T)
    if len(bad):
        p, q = (int(x) for x in bad[0])
        mine = {**_describe(ctx.header(0, 0)), "expects from rank %d" % p: int(expects[q, p])}
        theirs = {**_describe(ctx.header(0, 0)), "sends to rank %d" % q: int(sends[p, q])}
        raise CollectiveMismatch(ctx.name, ctx.seq, mine, theirs, peer=p, rank=q)
    return int(table.max())


def barrier(ctx: ShmContext) -> None:
    ctx.begin()
    ctx.exchange()
