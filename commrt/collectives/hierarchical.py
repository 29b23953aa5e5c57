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
flat path does). ``intra``/``inter`` are process groups (anything with ``backend`` and
``size()``); the caller checks that the world is laid out as ``rank = node * M + local``.
"""
from __future__ import annotations

import torch

from .reduce_ops import ReduceOp, finish_avg_


def _sum_op(op: ReduceOp) -> ReduceOp:
    return ReduceOp.SUM if op == ReduceOp.AVG else op


def all_reduce(intra, inter, flat: torch.Tensor, op: ReduceOp) -> None:
    """In place on a contiguous 1-D ``flat``."""
    m, n = intra.size(), flat.numel()
    part = -(-n // m)
    padded = flat if part * m == n else torch.zeros(part * m, dtype=flat.dtype, device=flat.device)
    if padded is not flat:  # the tail pads the last local rank's part; its values are dropped
        padded[:n].copy_(flat)
    shard = torch.empty(part, dtype=flat.dtype, device=flat.device)
    intra.backend.reduce_scatter_tensor(shard, padded, _sum_op(op), False)
    inter.backend.all_reduce(shard, _sum_op(op), False)
    intra.backend.all_gather_into_tensor(padded, shard, False)
    if padded is not flat:
        flat.copy_(padded[:n])
    if op == ReduceOp.AVG:
        finish_avg_(flat, m * inter.size())


def reduce_scatter(intra, inter, out: torch.Tensor, inp: torch.Tensor, op: ReduceOp) -> None:
    """``inp`` holds K*M chunks of ``out.numel()``; this rank gets the reduction of its chunk."""
    m, k, s = intra.size(), inter.size(), out.numel()
    by_local = inp.view(k, m, s).transpose(0, 1).contiguous()  # [M, K, s]: local rank l's K chunks together
    node_sums = torch.empty(k * s, dtype=out.dtype, device=out.device)
    intra.backend.reduce_scatter_tensor(node_sums, by_local.view(-1), _sum_op(op), False)
    inter.backend.reduce_scatter_tensor(out, node_sums, _sum_op(op), False)
    if op == ReduceOp.AVG:
        finish_avg_(out, m * k)


def all_gather(intra, inter, out: torch.Tensor, inp: torch.Tensor) -> None:
    """``out`` gets every rank's ``inp`` in global rank order."""
    m, k, s = intra.size(), inter.size(), inp.numel()
    same_local = torch.empty(k * s, dtype=inp.dtype, device=inp.device)
    inter.backend.all_gather_into_tensor(same_local, inp, False)  # chunks (0, l) .. (K-1, l)
    by_local = torch.empty(m * k * s, dtype=inp.dtype, device=inp.device)
    intra.backend.all_gather_into_tensor(by_local, same_local, False)  # [M, K, s]
    out.view(k, m, s).copy_(by_local.view(m, k, s).transpose(0, 1))


def link_bytes(kind: str, nbytes: int, nodes: int, per_node: int) -> tuple[float, float]:
    """(intra-node, inter-node) bytes one rank sends for the hierarchical ``kind`` on a payload of
    ``nbytes`` (all_reduce: the tensor; reduce_scatter: the input; all_gather: the output), on
    the bandwidth paths (ring) of each level."""
    k, m = nodes, per_node
    if kind == "all_reduce":
        return 2 * (m - 1) / m * nbytes, 2 * (k - 1) / k * nbytes / m
    if kind in ("reduce_scatter", "all_gather"):
        return (m - 1) / m * nbytes, (k - 1) / k * nbytes / m
    raise ValueError(f"link_bytes: unknown kind {kind!r}; valid: all_reduce, reduce_scatter, all_gather")
