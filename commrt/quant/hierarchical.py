"""Quantized collectives on a world that spans nodes: only the inter-node hop is quantized
(ZeRO++ qgZ's hierarchy, Wang et al. 2023, section 4.3), the node-local hops stay exact fp32.

With K nodes of M ranks (``rank = node * M + local``), ``intra`` this rank's node and ``inter``
the ranks with its local index on every node (``commrt.mesh``'s two-level groups):

- all_reduce: exact fp32 reduce-scatter inside the node (each local rank gets the node's sum of
  1/M of the tensor), quantized all_reduce of that part across nodes (``collectives``' flat
  composition over ``inter``), exact all-gather inside the node. The slow link carries the
  quantized 1/M once per direction; error bound: the inter all_reduce's (sum over nodes of
  s_k/2 for the node sums' blocks, plus s'/2 of the reduced block), no error inside the node.
- reduce_scatter: the chunks reordered to [M, K, s] (as ``collectives.hierarchical``), exact
  reduce-scatter inside the node, quantized reduce-scatter of the node sums across nodes:
  error <= sum over nodes of s_k/2 (AVG: divided by n).
- all_gather: quantized all-gather across nodes (every part through the codec, the own one
  too), exact all-gather inside the node: error <= s/2.

Every rank gets bit-identical results: the quantized hop's are (see ``exchange``), and the
node-local hops only move or add exactly what every rank of the node holds. A value that
cannot be encoded makes every rank raise after the last exchange: the encoding rank and its
inter peers learn of it from the hop's mark, the rest of the node from a NaN flag in the
last node-local exchange, and a rank whose own input was non-finite names its first bad element.
"""
from __future__ import annotations

import numpy as np
import torch

from .. import distributed as dist
from .. import mesh
from ..collectives.algorithms import chunk_bounds
from ..collectives.reduce_ops import ReduceOp
from .codecs import Codec
from .exchange import Hop, gather_hop, reduce_hop
from .feedback import ErrorFeedback
from .profile import add, span


def levels(group, nbytes: int):
    """(intra, inter) when ``group`` is the world spanning several nodes of M >= 2 ranks and
    ``[comm] hierarchical`` wants it for ``nbytes``; None: the flat quantized path."""
    rt = dist._rt()
    if rt.topology is None or rt.topology.num_nodes < 2 or group not in (None, rt.world):
        return None
    if not mesh.wants_hierarchical(group, nbytes):
        return None
    return mesh.node_groups()


def _own_problem(x: np.ndarray) -> list[str]:
    """The node-local hops would carry a non-finite input silently: name it here."""
    if x.size == 0 or np.isfinite(x).all():
        return []
    bad = int(np.flatnonzero(~np.isfinite(x))[0])
    return [f"cannot quantize a non-finite value: element {bad} is {x[bad]}"]


def _node_gather(part: np.ndarray, intra, problems: list[str]) -> np.ndarray:
    """Exact all-gather of ``part`` inside the node, returned as [M, part.size]. A rank that
    saw a problem sends a NaN first element (a decoded value never is NaN: the codec refuses
    non-finite input), so every rank of the node raises together, at no extra cost."""
    m = dist.get_world_size(intra)
    if problems and part.size:
        part[0] = np.nan
    recv = torch.empty(m * part.size, dtype=torch.float32)
    dist.all_gather_into_tensor(recv, torch.from_numpy(part), group=intra)
    rows = recv.numpy().reshape(m, part.size)
    if not problems and part.size and np.isnan(rows[:, 0]).any():
        problems.append("a rank of this node saw values that cannot be quantized (it raised naming them)")
    return rows


def all_reduce(x: np.ndarray, op: ReduceOp, codec: Codec, intra, inter, like: torch.Tensor,
               fb: ErrorFeedback | None) -> tuple[np.ndarray, list[Hop], int]:
    """(the reduced values, the quantized hops, fp32 bytes this rank sent inside the node)."""
    from .collectives import _all_reduce_hops  # the flat composition, reused for the inter hop
    m, k = dist.get_world_size(intra), dist.get_world_size(inter)
    part = -(-x.size // m)
    with span("copy_in"):
        if x.size == part * m:  # read in place: the reduce-scatter does not write its input
            padded = torch.from_numpy(np.asarray(x, dtype=np.float32))
        else:  # the tail pads the last local rank's part
            padded = torch.zeros(part * m, dtype=torch.float32)
            padded[:x.size] = torch.from_numpy(x)
    with span("check_finite"):
        own = _own_problem(x)
    shard = torch.empty(part, dtype=torch.float32)
    with span("node_rs"):
        dist.reduce_scatter_tensor(shard, padded, ReduceOp.SUM, group=intra)
    s = shard.numpy()
    sub = chunk_bounds(part, k)
    hops = _all_reduce_hops(s, sub, ReduceOp.SUM, k, codec, inter, like, fb, ".inter")
    add("cross_wire_bytes", sum(h.wire_bytes for h in hops))
    with span("copy_mid"):
        node_shard = np.empty(part, dtype=np.float32)
        for (a, b), v in zip(sub, hops[-1].values):
            node_shard[a:b] = v
        if op == ReduceOp.AVG:
            node_shard /= m * k
    problems = own + [p for h in hops for p in h.problems]
    with span("node_ag"):
        out = _node_gather(node_shard, intra, problems).reshape(-1)[:x.size]
    hops.append(Hop([], problems=problems))
    return out, hops, 2 * (m - 1) * part * 4


def reduce_scatter(x: np.ndarray, s: int, op: ReduceOp, codec: Codec, intra, inter, like: torch.Tensor,
                   fb: ErrorFeedback | None) -> tuple[np.ndarray, list[Hop], int]:
    """``x`` holds K*M chunks of ``s``; this rank's chunk reduced over the world."""
    m, k = dist.get_world_size(intra), dist.get_world_size(inter)
    by_local = torch.from_numpy(np.asarray(x, dtype=np.float32)).view(k, m, s).transpose(0, 1).contiguous()  # [M, K, s]
    node_sums = torch.empty(k * s, dtype=torch.float32)
    dist.reduce_scatter_tensor(node_sums, by_local.view(-1), ReduceOp.SUM, group=intra)
    hop = reduce_hop(node_sums.numpy(), [(j * s, (j + 1) * s) for j in range(k)], codec, inter, like.device,
                     like.element_size(), fb, "send.inter")
    hop.problems = _own_problem(x) + hop.problems
    acc = hop.values[0]
    if op == ReduceOp.AVG:
        acc /= m * k
    return acc, [hop], (m - 1) * k * s * 4


def all_gather(x: np.ndarray, codec: Codec, intra, inter, like: torch.Tensor,
               fb: ErrorFeedback | None) -> tuple[np.ndarray, list[Hop], int]:
    """Every rank's ``x`` in global rank order."""
    m, k, s = dist.get_world_size(intra), dist.get_world_size(inter), x.size
    hop = gather_hop(x, [s] * k, codec, inter, like.device, like.element_size(), fb, "gather.inter")
    same_local = np.concatenate(hop.values) if s else np.empty(0, dtype=np.float32)  # chunks (0, l) .. (K-1, l)
    by_local = _node_gather(same_local, intra, hop.problems)  # [M, K * s]
    out = np.ascontiguousarray(by_local.reshape(m, k, s).transpose(1, 0, 2)).reshape(-1)
    return out, [hop], (m - 1) * k * s * 4
