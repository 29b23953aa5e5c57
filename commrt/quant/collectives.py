"""Quantized all-gather, reduce-scatter and all-reduce, composed from the exact collectives on
bytes (``all_to_all_single`` / ``all_gather_into_tensor`` of uint8 tensors, see exchange.py),
so they run on every backend alike. Error bounds per element, s = the scale of the value's
block (its absmax / qmax) in the encoding rank:

- all_gather: every part, the own one too, through the codec: <= s_r/2; bit-identical results.
- reduce_scatter (ZeRO++ qgZ): each value quantized once, then summed in fp32 in rank order:
  <= sum_r s_r/2 (AVG: divided by n), plus the fp32 rounding of the sum.
- all_reduce = quantized reduce-scatter over ``chunk_bounds`` (any size, uneven shards) +
  quantized all-gather of the reduced shards: the reduce-scatter's bound + s'/2, s' the scale
  of the reduced block; bit-identical results on every rank.

Stochastic rounding (``[quant] rounding``) doubles each s/2 term. Each call takes ``quant``
("int8" / "int4"), optionally ``block`` (default ``[quant] block``) and ``feedback`` (an
``ErrorFeedback`` kept for this tensor). CPU tensors go through the numpy codec; tensors on
another device (CUDA) are encoded, exchanged, decoded and summed there by the torch codec,
which gives the same bytes and values (torch_codec.py), so mixed ranks still agree bit for bit.
The two-hop path of a multi-node world still stages device tensors through host memory. A value
that cannot be encoded makes every rank that depends on it raise ValueError, after the
exchange, with nothing written.
"""
from __future__ import annotations

import numpy as np
import torch

from commrt.collectives.algorithms import chunk_bounds
from commrt.collectives.reduce_ops import ReduceOp, as_op
from commrt.runtime import world
from commrt.runtime.work import Work
from commrt.quant import torch_codec
from commrt.quant.codecs import Codec, codec_for, store_float, to_numpy_float
from commrt.quant import kernels
from commrt.quant.exchange import Hop, all_reduce_hops, commit, gather_hop, reduce_hop
from commrt.quant import hierarchical as two_hop
from commrt.quant.feedback import ErrorFeedback
from commrt.quant.stats import STATS
from commrt.quant import profile
from commrt.topology import mesh

_REDUCING = (ReduceOp.SUM, ReduceOp.AVG)


def _codec(quant: str, block: int | None) -> Codec:
    q = world.current().config.quant
    profile.follow(q.profile)
    return codec_for(quant, block or q.block, q.scale_dtype, q.rounding)


def _check_op(op, what: str) -> ReduceOp:
    op = as_op(op)
    if op not in _REDUCING:
        raise ValueError(f"quantized {what} supports op {[o.name for o in _REDUCING]}; got {op.name}")
    return op


def _values(t, what: str):
    """The flat fp32 / fp64 values: a numpy array for a CPU tensor, a tensor on the device else."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu" or world.current().config.quant.cpu_codec == "torch":
        return torch_codec.values(t)
    return to_numpy_float(t.detach().reshape(-1))


def _host(x) -> np.ndarray:
    """The two-hop path computes on the host: a device tensor's values copied there."""
    return x.cpu().numpy() if isinstance(x, torch.Tensor) else x


def _done(async_op: bool, name: str):
    if not async_op:
        return None
    work = Work(name)  # the composition runs synchronously: hand back a finished handle
    work._finish(None, None)
    return work


def _settle(kind: str, hops: list[Hop], node_bytes: int = 0, path: str = "flat") -> None:
    """Record the stats (``node_bytes``: sent exact inside the node, by the two-hop path);
    raise (on every rank that saw one) the first problem of any hop, else keep the hops'
    error-feedback updates."""
    problems = [p for h in hops for p in h.problems]
    if problems:
        raise ValueError(f"quantized {kind}: {problems[0]}; nothing was written")
    commit(hops)
    STATS.record(kind, sum(h.wire_bytes for h in hops) + node_bytes, sum(h.exact_bytes for h in hops) + node_bytes,
                 max(h.max_abs_error for h in hops), max(h.max_error_bound for h in hops), path)


def _write(dst: torch.Tensor, pieces: list) -> None:
    """dst.view(-1)[start:start + len(v)] = v for each piece, rounded to dst's dtype."""
    if pieces and isinstance(pieces[0][1], torch.Tensor):
        _write_tensors(dst, pieces)
        return
    direct = dst.device.type == "cpu" and dst.is_contiguous()
    flat = dst.detach().view(-1) if direct else torch.empty(dst.numel(), dtype=dst.dtype)
    for start, v in pieces:
        store_float(flat[start:start + v.size], v)
    if not direct:
        with torch.no_grad():
            dst.copy_(flat.view(dst.shape))


def _write_tensors(dst: torch.Tensor, pieces: list[tuple[int, torch.Tensor]]) -> None:
    """The device path's _write: copy_ rounds to nearest even, as store_float does on the host."""
    with torch.no_grad():
        flat = dst.detach().view(-1) if dst.is_contiguous() else torch.empty(dst.numel(), dtype=dst.dtype, device=dst.device)
        for start, v in pieces:
            flat[start:start + len(v)].copy_(v)
        if not dst.is_contiguous():
            dst.copy_(flat.view(dst.shape))


def all_gather_into_tensor(output, input, group=None, async_op=False, quant: str = "int8",
                           block: int | None = None, feedback: ErrorFeedback | None = None):
    """Quantized ``all_gather_into_tensor``: ``output`` (n x input.numel()) gets every rank's
    ``input`` after one pass through the codec, bit-identical on every rank."""
    group = world.resolve(group)
    if group is None:
        return None
    n = group.size()
    codec, x = _codec(quant, block), _values(input, "input")
    if output.numel() != n * len(x):
        raise ValueError(f"quantized all_gather: output has {output.numel()} elements, expected {n} x {len(x)}")
    if feedback is not None:
        feedback.begin(len(x))
    if (lv := two_hop.levels(group, output.numel() * 4)) is not None:
        out, hops, node_bytes = two_hop.all_gather(_host(x), codec, *lv, input, feedback)
        _settle("all_gather", hops, node_bytes, "hierarchical")
        _write(output, [(0, out)])
        return _done(async_op, "quant all_gather")
    hop = gather_hop(x, [len(x)] * n, codec, group, input.device, input.element_size(), feedback)
    _settle("all_gather", [hop])
    _write(output, [(r * len(x), v) for r, v in enumerate(hop.values)])
    return _done(async_op, "quant all_gather")


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False, quant: str = "int8",
                          block: int | None = None, feedback: ErrorFeedback | None = None):
    """Quantized ``reduce_scatter_tensor`` (qgZ): rank r's ``output`` gets the SUM/AVG of
    chunk r of every rank's ``input``, reduced in fp32 from values quantized once."""
    op, group = _check_op(op, "reduce_scatter"), world.resolve(group)
    if group is None:
        return None
    n = group.size()
    codec, x = _codec(quant, block), _values(input, "input")
    m = output.numel()
    if len(x) != n * m:
        raise ValueError(f"quantized reduce_scatter: input has {len(x)} elements, expected {n} x {m}")
    if feedback is not None:
        feedback.begin(len(x))
    if (lv := two_hop.levels(group, len(x) * 4)) is not None:
        acc, hops, node_bytes = two_hop.reduce_scatter(_host(x), m, op, codec, *lv, input, feedback)
        _settle("reduce_scatter", hops, node_bytes, "hierarchical")
        _write(output, [(0, acc)])
        return _done(async_op, "quant reduce_scatter")
    hop = reduce_hop(x, [(r * m, (r + 1) * m) for r in range(n)], codec, group, input.device,
                     input.element_size(), feedback)
    _settle("reduce_scatter", [hop])
    acc = hop.values[0]
    if op == ReduceOp.AVG:
        kernels.of(acc).divide(acc, n)
    _write(output, [(0, acc)])
    return _done(async_op, "quant reduce_scatter")


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False, quant: str = "int8",
               block: int | None = None, feedback: ErrorFeedback | None = None):
    """Quantized ``all_reduce`` (SUM / AVG): quantized reduce-scatter, then quantized
    all-gather of the reduced shards; every rank ends with bit-identical values."""
    op, group = _check_op(op, "all_reduce"), world.resolve(group)
    if group is None:
        return None
    n = group.size()
    codec, x = _codec(quant, block), _values(tensor, "tensor")
    if feedback is not None:
        feedback.begin(len(x))
    if (lv := two_hop.levels(group, len(x) * 4)) is not None:
        if profile.enabled():
            profile.TAG[0] = f"{codec.name}.{len(x) * 4 >> 20}MiB."
            profile.add("calls", 1)
        with profile.span("total"):
            out, hops, node_bytes = two_hop.all_reduce(_host(x), op, codec, *lv, tensor, feedback)
            _settle("all_reduce", hops, node_bytes, "hierarchical")
            with profile.span("copy_out"):
                _write(tensor, [(0, out)])
        return _done(async_op, "quant all_reduce")
    bounds = chunk_bounds(len(x), n)
    hops = all_reduce_hops(x, bounds, op, n, codec, group, tensor, feedback)
    _settle("all_reduce", hops)
    _write(tensor, [(a, v) for (a, _), v in zip(bounds, hops[-1].values)])
    return _done(async_op, "quant all_reduce")


def hierarchical_all_reduce(tensor, op=ReduceOp.SUM, intra_group=None, inter_group=None, quant: str = "int8",
                            block: int | None = None, feedback: ErrorFeedback | None = None) -> None:
    """Two-hop quantized all_reduce for a multi-node job: a quantized reduce-scatter inside
    the node (``intra_group``: this node's ranks), a quantized all_reduce of the node's shard
    across nodes (``inter_group``: the ranks with this local index on every node), and a
    quantized all-gather inside the node. The slow inter-node link carries each value encoded
    once per direction, 1/L of the data (L ranks per node). Every rank gets bit-identical values.
    A group left None is that level of the world's node groups (``mesh.node_groups``; every
    rank makes them at the same call), never the world itself: a world "node" and a world
    "across" would add up unrelated shards. Error: the intra hop's sum_r s_r/2, plus the inter all_reduce's bound, plus s''/2 of the
    final intra gather."""
    op = _check_op(op, "all_reduce")
    codec, x = _codec(quant, block), _values(tensor, "tensor")
    if intra_group is None or inter_group is None:
        levels = mesh.node_groups()  # a ConfigError on nodes of different sizes, on every rank
        intra_group = levels[0] if intra_group is None else intra_group
        inter_group = levels[1] if inter_group is None else inter_group
    intra_group, inter_group = world.resolve(intra_group), world.resolve(inter_group)
    L, N = intra_group.size(), inter_group.size()
    if feedback is not None:
        feedback.begin(len(x))
    bounds = chunk_bounds(len(x), L)
    me = intra_group.rank
    intra = reduce_hop(x, bounds, codec, intra_group, tensor.device, tensor.element_size(), feedback, "send")
    shard = intra.values[0]
    if op == ReduceOp.AVG:
        kernels.of(shard).divide(shard, L * N)
    sub = chunk_bounds(len(shard), N)
    inter = all_reduce_hops(shard, sub, ReduceOp.SUM, N, codec, inter_group, tensor, feedback, ".inter")
    node_shard = kernels.of(shard).cat(inter[-1].values)  # the sub-shards in order
    last = gather_hop(node_shard, [b - a for a, b in bounds], codec, intra_group, tensor.device,
                      tensor.element_size(), feedback, "shard", offset=bounds[me][0])
    _settle("hierarchical_all_reduce", [intra, *inter, last])
    _write(tensor, [(a, v) for (a, _), v in zip(bounds, last.values)])
