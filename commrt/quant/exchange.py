"""The two quantized hops every collective here is made of, over one group each:

- ``reduce_hop``: the values meant for each rank are encoded once, one all-to-all of bytes,
  each rank decodes what it received and sums it in fp32 in rank order (ZeRO++ qgZ).
- ``gather_hop``: each rank's part encoded once, one all-gather of bytes, every part decoded.

A hierarchical (two-hop) collective is these over an intra-node group, then an inter-node
group (see ``collectives.hierarchical_all_reduce``). Nothing is raised between the exchange and
its end: a rank with an unencodable block marks it (a NaN scale) and still takes part, so every
rank that receives the mark learns of it, and nobody waits for a rank that gave up.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .. import distributed as dist
from .codecs import Codec
from .feedback import ErrorFeedback
from .profile import add, span


@dataclass
class Hop:
    """What one hop produced, and what it cost (for ``comm_stats``)."""
    values: list[np.ndarray]
    wire_bytes: int = 0
    exact_bytes: int = 0
    max_abs_error: float = 0.0
    max_error_bound: float = 0.0
    problems: list[str] = field(default_factory=list)


def _exchange(fn, send: np.ndarray, recv: np.ndarray, device: torch.device, group, **kw) -> None:
    """Run an exact collective on uint8 buffers, on the tensors' device (NCCL needs CUDA)."""
    s, r = torch.from_numpy(send), torch.from_numpy(recv)
    if device.type != "cpu":
        s, r = s.to(device), torch.empty(recv.size, dtype=torch.uint8, device=device)
    with span("cross_exchange"):
        fn(r, s, group=group, **kw)
    if device.type != "cpu":
        recv[:] = r.cpu().numpy()


def _bound(codec: Codec, scale: float) -> float:
    return scale * (0.5 if codec.rounding == "nearest" else 1.0)


def reduce_hop(x: np.ndarray, bounds: list[tuple[int, int]], codec: Codec, group, device: torch.device,
               itemsize: int, fb: ErrorFeedback | None = None, stage: str = "send") -> Hop:
    """Quantized reduce-scatter of ``x`` cut at ``bounds`` (one range per group rank): this
    rank's range summed over the group in fp32, as ``Hop.values[0]``."""
    n, me = len(bounds), dist.get_rank(group)
    sizes = [codec.nbytes(b - a) for a, b in bounds]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    src = fb.compensate(stage, x) if fb is not None else x
    send = np.empty(int(offsets[-1]), dtype=np.uint8)
    hop = Hop([])
    with span("encode"):
        for j, (a, b) in enumerate(bounds):
            scale, bad = codec.encode_into(send[offsets[j]:offsets[j + 1]], src[a:b], offset=a, mark=True)
            hop.max_error_bound = max(hop.max_error_bound, _bound(codec, scale))
            hop.problems += [bad] if bad else []
    recv = np.empty(n * sizes[me], dtype=np.uint8)
    _exchange(dist.all_to_all_single, send, recv, device, group,
              output_split_sizes=[sizes[me]] * n, input_split_sizes=sizes)
    a, b = bounds[me]
    acc = np.zeros(b - a, dtype=np.float32)
    with span("decode_reduce"):
        _decode_sum(codec, recv, sizes[me], n, me, a, b, src, acc, hop)
    if fb is not None and not hop.problems:
        fb.update(stage, src, np.concatenate([codec.decode(send[offsets[j]:offsets[j + 1]], hi - lo)
                                              for j, (lo, hi) in enumerate(bounds)]))
    hop.values = [acc]
    hop.wire_bytes = int(offsets[-1]) - sizes[me]
    hop.exact_bytes = (x.size - (b - a)) * itemsize
    return hop


def _decode_sum(codec: Codec, recv: np.ndarray, size: int, n: int, me: int, a: int, b: int, src: np.ndarray,
                acc: np.ndarray, hop: Hop) -> None:
    """acc += each rank's decoded part, in rank order: the same sum wherever it is computed."""
    for r in range(n):
        buf = recv[r * size:(r + 1) * size]
        if r != me and codec.marked(buf, b - a):
            hop.problems.append(f"rank {r} of the group sent values that cannot be quantized (it raised naming them)")
        part = codec.decode(buf, b - a)
        acc += part
        if r == me and b > a and not hop.problems:
            hop.max_abs_error = float(np.abs(part - src[a:b]).max())


def gather_hop(own: np.ndarray, counts: list[int], codec: Codec, group, device: torch.device, itemsize: int,
               fb: ErrorFeedback | None = None, stage: str = "gather", offset: int = 0) -> Hop:
    """Quantized all-gather of one part per group rank (``counts`` values each, uneven
    allowed): every part decoded to fp32, in rank order, as ``Hop.values``."""
    n, me = len(counts), dist.get_rank(group)
    width = max(codec.nbytes(c) for c in counts)  # uneven parts: each padded to the largest
    src = fb.compensate(stage, own) if fb is not None else own
    send = np.zeros(width, dtype=np.uint8)
    with span("encode"):
        scale, bad = codec.encode_into(send[:codec.nbytes(own.size)], src, offset=offset, mark=True)
    hop = Hop([], max_error_bound=_bound(codec, scale), problems=[bad] if bad else [])
    recv = np.empty(n * width, dtype=np.uint8)
    _exchange(dist.all_gather_into_tensor, send, recv, device, group)
    with span("decode"):
        for r, c in enumerate(counts):
            buf = recv[r * width:r * width + codec.nbytes(c)]
            if r != me and codec.marked(buf, c):
                hop.problems.append(f"rank {r} of the group sent values that cannot be quantized (it raised naming them)")
            hop.values.append(codec.decode(buf, c))
    if not hop.problems:
        if fb is not None:
            fb.update(stage, src, hop.values[me])
        hop.max_abs_error = float(np.abs(hop.values[me] - src).max()) if own.size else 0.0
    hop.wire_bytes = width * (n - 1)
    hop.exact_bytes = own.size * (n - 1) * itemsize
    return hop
