"""Two-level collectives composed from two groups (no new transport): ``intra`` holds this
rank's node (M ranks), ``inter`` the same local rank on every node (K ranks).

all_reduce (as NCCL's tree/ring hybrids and Horovod's hierarchical allreduce do): reduce-scatter
inside the node, all-reduce of this rank's 1/M part across nodes, all-gather inside the node.
Each node's link then carries 2(K-1)/K of the payload instead of the flat ring's 2(n-1)/n,
counted per node, since the flat ring crosses every node boundary with the whole payload.

reduce_scatter / all_gather: the global rank ``k*M + l`` owns chunk ``k*M + l``. Reordering the
chunks to [M, K, s] lets the node reduce-scatter hand local rank ``l`` the node's sums of chunks
(0, l), (1, l), ... (K-1, l); the cross-node reduce-scatter over ``inter`` then leaves chunk
(k, l) on node k. all_gather runs the same steps backwards. Only 1/M of the data crosses nodes.

broadcast is not here: the flat one is already a chain that crosses each node boundary once.

Each level is one of our flat collectives, whose results are bit-identical on every rank, so
the composition's are too. AVG runs as SUM and divides once at the end (integers floor, as the
flat path does); float16 and bfloat16 divide each rank's part by the world size first instead
(reduce_ops.divides_first), so that the node's sums cannot overflow where the mean fits.
``intra``/``inter`` are process groups (anything with ``backend`` and ``size()``); the caller
checks that the world is laid out as ``rank = node * M + local``.
"""
from __future__ import annotations

from commrt.collectives.reduce_ops import ReduceOp, avg_part, finish_avg_
from commrt.runtime.arrays import assign, empty, numel, swap_blocks, swap_blocks_into, zeros


def _sum_op(op: ReduceOp) -> ReduceOp:
    return ReduceOp.SUM if op == ReduceOp.AVG else op


def all_reduce(intra, inter, flat, op: ReduceOp, segments: int = 1) -> None:
    """In place on a contiguous 1-D ``flat``, cut into ``segments`` pipelined pieces: the node's
    reduce-scatter of piece i+1 runs while piece i crosses the nodes (the groups have their own
    executors), so the slow link is not left idle during the node-local steps."""
    m, n = intra.size(), numel(flat)
    avg_part(flat, op, m * inter.size())  # a half-precision AVG divides first
    per = max(m, -(-n // max(1, segments) // m) * m)  # a multiple of M: no padding but in the last piece
    # an empty buffer is one empty piece: its ops still run, so a rank whose buffer is not empty
    # meets a mismatch, not a peer that skipped the op (ops.py)
    pieces = [_Piece(flat[a:min(a + per, n)], m) for a in range(0, n, per)] or [_Piece(flat, m)]
    works: list = []
    try:
        for p in pieces:  # issue order is the same on every rank: all RS, then AR and AG in turn
            p.rs = intra.backend.reduce_scatter_tensor(p.shard, p.padded, _sum_op(op), True)
            works.append(p.rs)
        for p in pieces:
            p.rs.wait()
            p.ar = inter.backend.all_reduce(p.shard, _sum_op(op), True)
            works.append(p.ar)
        for p in pieces:
            p.ar.wait()
            p.ag = intra.backend.all_gather_into_tensor(p.padded, p.shard, True)
            works.append(p.ag)
        for p in pieces:
            p.ag.wait()
            p.finish()
    finally:  # never return while a queued op may still read or write our buffers
        drain(works)
    if op == ReduceOp.AVG:
        finish_avg_(flat, m * inter.size())


class _Piece:
    """One pipelined piece of an all_reduce: its (padded) data and this rank's 1/M shard."""

    def __init__(self, data, m: int):
        self.data, part = data, -(-numel(data) // m)
        self.padded = data if part * m == numel(data) else zeros(part * m, data)
        if self.padded is not data:  # the tail pads the last local rank's part; its values are dropped
            assign(self.padded[:numel(data)], data)
        self.shard = empty(part, data)
        self.rs = self.ar = self.ag = None

    def finish(self) -> None:
        if self.padded is not self.data:
            assign(self.data, self.padded[:numel(self.data)])


def reduce_scatter(intra, inter, out, inp, op: ReduceOp) -> None:
    """``inp`` holds K*M chunks of ``out.numel()``; this rank gets the reduction of its chunk."""
    m, k, s = intra.size(), inter.size(), numel(out)
    by_local = swap_blocks(inp, k, m, s)  # [M, K, s]: local rank l's K chunks together
    avg_part(by_local, op, m * k)  # a half-precision AVG divides first (a copy: inp stays)
    node_sums = empty(k * s, out)
    intra.backend.reduce_scatter_tensor(node_sums, by_local, _sum_op(op), False)
    inter.backend.reduce_scatter_tensor(out, node_sums, _sum_op(op), False)
    if op == ReduceOp.AVG:
        finish_avg_(out, m * k)


def all_gather(intra, inter, out, inp) -> None:
    """``out`` gets every rank's ``inp`` in global rank order."""
    m, k, s = intra.size(), inter.size(), numel(inp)
    same_local = empty(k * s, inp)
    inter.backend.all_gather_into_tensor(same_local, inp, False)  # chunks (0, l) .. (K-1, l)
    by_local = empty(m * k * s, inp)
    intra.backend.all_gather_into_tensor(by_local, same_local, False)  # [M, K, s]
    swap_blocks_into(out, by_local, m, k, s)


def drain(works: list) -> None:
    """Wait for every queued op of a composition that is giving up (None entries skipped):
    their buffers are the caller's. Their errors are dropped: the first is already on its way up."""
    for w in works:
        if w is not None and not w.is_completed():
            try:
                w.wait()
            except BaseException:
                pass
