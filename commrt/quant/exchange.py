"""The two quantized hops every collective here is made of, over one group each:

- ``reduce_hop``: the values meant for each rank are encoded once, one all-to-all of bytes,
  each rank decodes what it received and sums it in fp32 in rank order (ZeRO++ qgZ).
- ``gather_hop``: each rank's part encoded once, one all-gather of bytes, every part decoded.

A hierarchical (two-hop) collective is these over an intra-node group, then an inter-node
group (see ``collectives.hierarchical_all_reduce``). Nothing is raised between the exchange and
its end: a rank with an unencodable block marks it (a NaN scale) and still takes part, so every
rank that receives the mark learns of it, and nobody waits for a rank that gave up.

The values are numpy arrays (the codec on the host; a CUDA tensor's bytes are still exchanged
on its device) or torch tensors (the torch codec on their device: encode, exchange, decode and
the fp32 sum never leave it); ``kernels`` picks the side, the bytes and sums are the same.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import torch

from commrt.collectives.reduce_ops import ReduceOp
from commrt.quant import kernels
from commrt.topology import dispatch
from commrt.quant.codecs import Codec
from commrt.quant.feedback import ErrorFeedback
from commrt.quant.profile import span


@dataclass
class Hop:
    """What one hop produced, and what it cost (for ``comm_stats``)."""
    values: list  # np.ndarray or torch.Tensor, as the hop's input
    wire_bytes: int = 0
    exact_bytes: int = 0
    max_abs_error: float = 0.0
    max_error_bound: float = 0.0
    problems: list[str] = field(default_factory=list)
    feedback: list = field(default_factory=list)
    """(ErrorFeedback, stage, compensated, decoded): applied by ``commit`` once every hop of
    the collective succeeded, so a call that raises leaves every rank's error memory as it was
    (a rank whose own hop went well must not remember values that were never delivered)."""


def commit(hops: list[Hop]) -> None:
    """Apply the hops' error-feedback updates; the caller has checked that no hop has problems."""
    for hop in hops:
        for fb, stage, compensated, decoded in hop.feedback:
            fb.update(stage, compensated, decoded)


def _exchange(fn, send, recv, device: torch.device, group, **kw) -> None:
    """Run an exact collective on uint8 buffers, on the tensors' device (NCCL needs CUDA):
    torch tensors are there already; numpy buffers are staged to it and back."""
    if isinstance(send, torch.Tensor):
        with span("cross_exchange"):
            fn(recv, send, group=group, **kw)
        return
    s, r = torch.from_numpy(send), torch.from_numpy(recv)
    if device.type != "cpu":
        s, r = s.to(device), torch.empty(recv.size, dtype=torch.uint8, device=device)
    with span("cross_exchange"):
        fn(r, s, group=group, **kw)
    if device.type != "cpu":
        recv[:] = r.cpu().numpy()


def _bound(codec: Codec, scale: float) -> float:
    return scale * (0.5 if codec.rounding == "nearest" else 1.0)


def reduce_hop(x, bounds: list[tuple[int, int]], codec: Codec, group, device: torch.device,
               itemsize: int, fb: ErrorFeedback | None = None, stage: str = "send") -> Hop:
    """Quantized reduce-scatter of ``x`` cut at ``bounds`` (one range per group rank): this
    rank's range summed over the group in fp32, as ``Hop.values[0]``."""
    k, n, me = kernels.of(x), len(bounds), group.rank
    sizes = [codec.nbytes(b - a) for a, b in bounds]
    offsets = [0, *accumulate(sizes)]
    src = fb.compensate(stage, x) if fb is not None else x
    send = k.empty_bytes(offsets[-1], x)
    hop = Hop([])
    with span("encode"):
        for j, (a, b) in enumerate(bounds):
            scale, bad = k.encode(codec, send[offsets[j]:offsets[j + 1]], src[a:b], a)
            hop.max_error_bound = max(hop.max_error_bound, _bound(codec, scale))
            hop.problems += [bad] if bad else []
    recv = k.empty_bytes(n * sizes[me], x)
    _exchange(dispatch.all_to_all_single, send, recv, device, group,
              output_split_sizes=[sizes[me]] * n, input_split_sizes=sizes)
    a, b = bounds[me]
    acc = k.zero_floats(b - a, x)
    with span("decode_reduce"):
        _decode_sum(k, codec, recv, sizes[me], n, me, a, b, src, acc, hop)
    if fb is not None and not hop.problems:
        hop.feedback.append((fb, stage, src, k.cat([k.decode(codec, send[offsets[j]:offsets[j + 1]], hi - lo)
                                                    for j, (lo, hi) in enumerate(bounds)])))
    hop.values = [acc]
    hop.wire_bytes = offsets[-1] - sizes[me]
    hop.exact_bytes = (len(x) - (b - a)) * itemsize
    return hop


def _decode_sum(k, codec: Codec, recv, size: int, n: int, me: int, a: int, b: int, src, acc, hop: Hop) -> None:
    """acc += each rank's decoded part, in rank order: the same sum wherever it is computed."""
    for r in range(n):
        buf = recv[r * size:(r + 1) * size]
        if r != me and k.marked(codec, buf, b - a):
            hop.problems.append(f"rank {r} of the group sent values that cannot be quantized (it raised naming them)")
        if r != me:  # decode and sum in one pass (fused on a GPU); the same roundings
            k.decode_add(codec, buf, b - a, acc)
            continue
        part = k.decode(codec, buf, b - a)
        acc += part
        if not hop.problems:
            hop.max_abs_error = k.max_abs_diff(part, src[a:b])


def gather_hop(own, counts: list[int], codec: Codec, group, device: torch.device, itemsize: int,
               fb: ErrorFeedback | None = None, stage: str = "gather", offset: int = 0) -> Hop:
    """Quantized all-gather of one part per group rank (``counts`` values each, uneven
    allowed): every part decoded to fp32, in rank order, as ``Hop.values``."""
    k, n, me = kernels.of(own), len(counts), group.rank
    width = max(codec.nbytes(c) for c in counts)  # uneven parts: each padded to the largest
    src = fb.compensate(stage, own) if fb is not None else own
    send = k.zero_bytes(width, own)
    with span("encode"):
        scale, bad = k.encode(codec, send[:codec.nbytes(len(own))], src, offset)
    hop = Hop([], max_error_bound=_bound(codec, scale), problems=[bad] if bad else [])
    recv = k.empty_bytes(n * width, own)
    _exchange(dispatch.all_gather_into_tensor, send, recv, device, group)
    with span("decode"):
        for r, c in enumerate(counts):
            buf = recv[r * width:r * width + codec.nbytes(c)]
            if r != me and k.marked(codec, buf, c):
                hop.problems.append(f"rank {r} of the group sent values that cannot be quantized (it raised naming them)")
            hop.values.append(k.decode(codec, buf, c))
    if not hop.problems:
        if fb is not None:
            hop.feedback.append((fb, stage, src, hop.values[me]))
        hop.max_abs_error = k.max_abs_diff(hop.values[me], src)
    hop.wire_bytes = width * (n - 1)
    hop.exact_bytes = len(own) * (n - 1) * itemsize
    return hop


def all_reduce_hops(x, bounds, op, n, codec, group, like, fb, tag: str = "") -> list[Hop]:
    """Quantized all_reduce of ``x`` over ``group`` as two hops: a reduce-scatter at ``bounds``,
    then an all-gather of the reduced shards (used flat, and for the inter-node hop)."""
    first = reduce_hop(x, bounds, codec, group, like.device, like.element_size(), fb, "send" + tag)
    acc = first.values[0]
    if op == ReduceOp.AVG:
        kernels.of(acc).divide(acc, n)
    me = group.rank
    second = gather_hop(acc, [b - a for a, b in bounds], codec, group, like.device, like.element_size(), fb,
                        "shard" + tag, offset=bounds[me][0])
    if second.problems and not first.problems and not kernels.of(acc).all_finite(acc):
        # every input encoded, so the shard is not finite because the fp32 sum overflowed:
        # say so, rather than name an element the caller never passed as non-finite
        first.problems.append(f"the {op.name} of finite inputs overflowed float32 in this rank's shard "
                              f"(elements {bounds[me][0]}..{bounds[me][1] - 1})")
    return [first, second]
