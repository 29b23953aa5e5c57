"""Which server holds which part of which tensor: a pure function every worker computes alike.

The named tensors are laid end to end in one byte space (in the order given) and that space is
cut into S nearly equal ranges, one per server, so no server carries more than its share
(ps-lite assigns key ranges the same way). A range boundary may fall inside a tensor: the tensor
is then split. Each server's range is further cut into segments of at most ``max_segment_bytes``
(one wire frame each). With ``whole_tensors`` (LAMB, whose trust ratio needs a tensor's full
norm on one server) tensors are never split across servers; they are placed greedily instead.
"""
from __future__ import annotations

from typing import NamedTuple


class Segment(NamedTuple):
    name: str
    start: int  # first element of the tensor (flattened)
    stop: int   # one past the last element
    server: int
    dtype: int  # wire dtype code

    @property
    def numel(self) -> int:
        return self.stop - self.start


class TensorSpec(NamedTuple):
    name: str
    numel: int
    itemsize: int
    dtype: int


def _server_cuts(specs: list[TensorSpec], servers: int) -> list[int]:
    """Element-aligned byte offsets where each server's range starts (byte-balanced)."""
    total = sum(s.numel * s.itemsize for s in specs)
    return [total * i // servers for i in range(servers)] + [total]


def _greedy_servers(specs: list[TensorSpec], servers: int) -> list[int]:
    """Largest tensor first onto the least loaded server (ties: lowest index)."""
    load = [0] * servers
    owner = [0] * len(specs)
    for i in sorted(range(len(specs)), key=lambda i: (-specs[i].numel * specs[i].itemsize, i)):
        target = min(range(servers), key=lambda s: (load[s], s))
        owner[i] = target
        load[target] += specs[i].numel * specs[i].itemsize
    return owner


def _split(seg: Segment, max_elems: int) -> list[Segment]:
    return [seg._replace(start=a, stop=min(a + max_elems, seg.stop))
            for a in range(seg.start, seg.stop, max_elems)] or [seg]


def partition(specs: list[TensorSpec], servers: int, max_segment_bytes: int,
              whole_tensors: bool = False) -> list[Segment]:
    """Segments covering every element of every tensor exactly once, in tensor order."""
    if servers < 1:
        raise ValueError(f"need at least one server, got {servers}")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError("tensor names must be unique")
    out: list[Segment] = []
    if whole_tensors:
        owners = _greedy_servers(specs, servers)
        for spec, server in zip(specs, owners):
            seg = Segment(spec.name, 0, spec.numel, server, spec.dtype)
            out += _split(seg, max(1, max_segment_bytes // spec.itemsize))
        return out
    cuts = _server_cuts(specs, servers)
    offset = 0  # byte offset of the current tensor in the joint space
    for spec in specs:
        begin, end = offset, offset + spec.numel * spec.itemsize
        for server in range(servers):
            lo, hi = max(begin, cuts[server]), min(end, cuts[server + 1])
            first = -(-(lo - begin) // spec.itemsize)  # element-aligned
            last = -(-(hi - begin) // spec.itemsize) if hi < end else spec.numel
            if lo < hi and first < last:
                seg = Segment(spec.name, first, last, server, spec.dtype)
                out += _split(seg, max(1, max_segment_bytes // spec.itemsize))
        if spec.numel == 0:
            out.append(Segment(spec.name, 0, 0, 0, spec.dtype))
        offset = end
    return out
