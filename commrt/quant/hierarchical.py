"""Quantized collectives on a world that spans nodes: only the inter-node hop is quantized
(ZeRO++ qgZ's hierarchy, Wang et al. 2023, section 4.3), the node-local hops stay exact fp32.

With K nodes of M ranks (``rank = node * M + local``), ``intra`` this rank's node and ``inter``
the ranks with its local index on every node (``commrt.topology.mesh``'s two-level groups):

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

from commrt.runtime import world
from commrt.topology import dispatch, mesh
from commrt.collectives.algorithms import chunk_bounds
from commrt.collectives.hierarchical import drain
from commrt.collectives.reduce_ops import ReduceOp
from commrt.quant.codecs import Codec
from commrt.quant.exchange import Hop, all_reduce_hops, gather_hop, reduce_hop
from commrt.quant.feedback import ErrorFeedback
from commrt.quant.profile import add, span
from commrt.runtime.config import QuantConfig  # [quant] pieces: at most this many pipelined pieces


def levels(group, nbytes: int):
    """(intra, inter) when ``group`` is the world spanning several nodes of M >= 2 ranks and
    ``[comm] hierarchical`` wants it for ``nbytes`` ("auto": whenever each rank's part across
    nodes exceeds small_bytes, ``dispatch.wants_hierarchical``); None: the flat quantized path."""
    rt = world.current()
    if rt.topology is None or rt.topology.num_nodes < 2 or group not in (None, rt.world):
        return None
    if not dispatch.wants_hierarchical(group, nbytes, "a quantized collective", quantized=True):
        return None
    return mesh.node_groups()


MIN_PIECE = 1 << 20
"""Elements: a smaller payload is not cut (each piece costs a few collective calls)."""


def piece_bounds(n: int, unit: int, pieces: int = QuantConfig.pieces, min_piece: int | None = None) -> list[tuple[int, int]]:
    """[a, b) cuts of ``n`` values into at most ``pieces`` of at least ``min_piece``, each a
    multiple of ``unit`` but the last (so every piece but the last splits into whole blocks
    on every rank and needs no padding)."""
    count = max(1, min(pieces, n // max(1, MIN_PIECE if min_piece is None else min_piece)))
    per = max(unit, -(-(-(-n // count)) // unit) * unit)
    return [(a, min(a + per, n)) for a in range(0, n, per)] or [(0, 0)]


def _own_problem(x: np.ndarray, offset: int = 0) -> list[str]:
    """The node-local hops would carry a non-finite input silently: name it here."""
    if x.size == 0 or np.isfinite(x).all():
        return []
    bad = int(np.flatnonzero(~np.isfinite(x))[0])
    return [f"cannot quantize a non-finite value: element {offset + bad} is {x[bad]}"]


def _node_gather(part: np.ndarray, intra, problems: list[str]) -> np.ndarray:
    """Exact all-gather of ``part`` inside the node, returned as [M, part.size]; the NaN
    flag of ``_Piece.gather`` tells every rank of the node about a problem."""
    m = intra.size()
    if problems and part.size:
        part[0] = np.nan
    recv = torch.empty(m * part.size, dtype=torch.float32)
    dispatch.all_gather_into_tensor(recv, torch.from_numpy(part), group=intra)
    rows = recv.numpy().reshape(m, part.size)
    if not problems and part.size and np.isnan(rows[:, 0]).any():
        problems.append("a rank of this node saw values that cannot be quantized (it raised naming them)")
    return rows


class _Piece:
    """One pipelined piece ``x[a:b]`` of the two-hop all_reduce: its (padded) fp32 input,
    this rank's 1/M shard of the node's sum, and the node-gathered result rows."""

    def __init__(self, x: np.ndarray, a: int, b: int, m: int, out: np.ndarray):
        self.a, self.b, self.part = a, b, -(-(b - a) // m)
        with span("copy_in"):
            self.direct = b - a == self.part * m
            if self.direct:  # read in place: the reduce-scatter does not write its input
                self.padded = torch.from_numpy(np.asarray(x[a:b], dtype=np.float32))
                self.rows = torch.from_numpy(out[a:b])  # gathered straight into the result
            else:  # the tail pads the last local rank's part
                self.padded = torch.zeros(self.part * m, dtype=torch.float32)
                self.padded[:b - a] = torch.from_numpy(x[a:b])
                self.rows = torch.empty(self.part * m, dtype=torch.float32)
        with span("check_finite"):
            self.problems = _own_problem(x[a:b], a)
        self.shard = torch.empty(self.part, dtype=torch.float32)
        self.rs = self.ag = None

    def gather(self, node_shard: np.ndarray, intra, m: int) -> None:
        """Issue the node's all-gather; a rank that saw a problem sends a NaN first element (a
        decoded value never is NaN: the codec refuses non-finite input), so every rank of the
        node raises together, at no extra cost."""
        if self.problems and node_shard.size:
            node_shard[0] = np.nan
        self.ag = dispatch.all_gather_into_tensor(self.rows, torch.from_numpy(node_shard), group=intra, async_op=True)

    def finish(self, out: np.ndarray, m: int) -> None:
        with span("node_ag"):
            self.ag.wait()
        rows = self.rows.numpy()
        if not self.problems and self.part and np.isnan(rows[::self.part]).any():
            self.problems.append("a rank of this node saw values that cannot be quantized (it raised naming them)")
        if not self.direct:
            with span("copy_mid"):
                out[self.a:self.b] = rows[:self.b - self.a]


def all_reduce(x: np.ndarray, op: ReduceOp, codec: Codec, intra, inter, like: torch.Tensor,
               fb: ErrorFeedback | None) -> tuple[np.ndarray, list[Hop], int]:
    """(the reduced values, the quantized hops, fp32 bytes this rank sent inside the node).
    Cut in pieces (none with error feedback, whose state is kept per whole tensor): every
    node-local reduce-scatter is issued at once on the node group's executor, then piece by
    piece the quantized hop runs across nodes while the node group reduces later pieces and
    gathers earlier ones. Each piece is the one-piece algorithm on ``x[a:b]``."""
    m, k = intra.size(), inter.size()
    cuts = piece_bounds(x.size, m * k * codec.block, 1 if fb is not None else world.current().config.quant.pieces)
    out = np.empty(x.size, dtype=np.float32)
    pieces = [_Piece(x, a, b, m, out) for a, b in cuts]
    hops: list[Hop] = []
    try:
        for p in pieces:
            p.rs = dispatch.reduce_scatter_tensor(p.shard, p.padded, ReduceOp.SUM, group=intra, async_op=True)
        for p in pieces:
            with span("node_rs"):
                p.rs.wait()
            sub = chunk_bounds(p.part, k)
            piece_hops = all_reduce_hops(p.shard.numpy(), sub, ReduceOp.SUM, k, codec, inter, like, fb, ".inter")
            add("cross_wire_bytes", sum(h.wire_bytes for h in piece_hops))
            hops += piece_hops
            with span("copy_mid"):
                node_shard = np.concatenate(piece_hops[-1].values) if p.part else np.empty(0, np.float32)
                if op == ReduceOp.AVG:
                    node_shard /= m * k
            p.problems += [q for h in piece_hops for q in h.problems]
            p.gather(node_shard, intra, m)
        for p in pieces:
            p.finish(out, m)
    finally:  # never return while a queued op may still read or write our buffers
        drain([w for p in pieces for w in (p.rs, p.ag)])
    problems = [q for p in pieces for q in p.problems]
    hops.append(Hop([], problems=problems))
    return out, hops, sum(2 * (m - 1) * p.part * 4 for p in pieces)


def reduce_scatter(x: np.ndarray, s: int, op: ReduceOp, codec: Codec, intra, inter, like: torch.Tensor,
                   fb: ErrorFeedback | None) -> tuple[np.ndarray, list[Hop], int]:
    """``x`` holds K*M chunks of ``s``; this rank's chunk reduced over the world."""
    m, k = intra.size(), inter.size()
    by_local = torch.from_numpy(np.asarray(x, dtype=np.float32)).view(k, m, s).transpose(0, 1).contiguous()  # [M, K, s]
    node_sums = torch.empty(k * s, dtype=torch.float32)
    dispatch.reduce_scatter_tensor(node_sums, by_local.view(-1), ReduceOp.SUM, group=intra)
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
    m, k, s = intra.size(), inter.size(), x.size
    hop = gather_hop(x, [s] * k, codec, inter, like.device, like.element_size(), fb, "gather.inter")
    same_local = np.concatenate(hop.values) if s else np.empty(0, dtype=np.float32)  # chunks (0, l) .. (K-1, l)
    by_local = _node_gather(same_local, intra, hop.problems)  # [M, K * s]
    out = np.ascontiguousarray(by_local.reshape(m, k, s).transpose(1, 0, 2)).reshape(-1)
    return out, [hop], (m - 1) * k * s * 4
