"""Point-to-point transfer of tensor lists whose shapes and dtypes the receiver does not know, and
torch's ``batch_isend_irecv``, over the public ``isend``/``irecv``.

A message is a fixed-size header tensor (a versioned msgpack array of integers: caller metadata,
then ``[dtype code, *shape]`` per tensor; never pickle) followed by one raw payload per non-empty
tensor, all on the same (peer, tag), which both transports deliver in order. Sends are posted and
return at once, so posting sends and receives together never waits on ordering.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Callable

import msgpack
import torch

from commrt import distributed as dist
from commrt.runtime import dtypes
from commrt.runtime.errors import ProtocolError

VERSION = 1
HEADER_BYTES = 1024  # room for ~30 tensors of rank 4; a longer list is refused before sending
MAX_NDIM, MAX_TENSORS, MAX_DIM = 8, 64, 1 << 40
MAX_MESSAGE_BYTES = 1 << 40  # a tensor list's payloads together; a header claiming more is refused


def encode_header(tensors: list[torch.Tensor], meta: tuple[int, ...] = ()) -> bytes:
    specs = [[dtypes.code_of(t.dtype), *t.shape] for t in tensors]
    body = msgpack.packb([VERSION, list(meta), specs])
    if len(tensors) > MAX_TENSORS or any(len(s) - 1 > MAX_NDIM for s in specs) or len(body) + 4 > HEADER_BYTES:
        raise ValueError(f"tensor list too large for one message: {len(tensors)} tensors, header "
                         f"{len(body)} bytes (at most {MAX_TENSORS} tensors of rank <= {MAX_NDIM}, "
                         f"{HEADER_BYTES - 4} bytes)")
    return struct.pack("<I", len(body)) + body + bytes(HEADER_BYTES - 4 - len(body))


def decode_header(data: bytes) -> tuple[tuple[int, ...], list[tuple[torch.dtype, tuple[int, ...]]]]:
    """(meta, [(dtype, shape)]); anything but the exact layout encode_header writes is a ProtocolError."""
    if len(data) != HEADER_BYTES:
        raise ProtocolError(f"tensor-list header of {len(data)} bytes, expected {HEADER_BYTES}")
    (n,) = struct.unpack_from("<I", data)
    if n > HEADER_BYTES - 4:
        raise ProtocolError(f"tensor-list header claims {n} bytes")
    try:
        obj = msgpack.unpackb(data[4:4 + n], raw=True, max_str_len=0, max_bin_len=0, max_map_len=0,
                              max_ext_len=0, max_array_len=MAX_TENSORS + MAX_NDIM + 1)
    except Exception as exc:  # msgpack raises several unrelated types on bad input
        raise ProtocolError(f"undecodable tensor-list header: {exc}") from None
    if not (isinstance(obj, list) and len(obj) == 3 and obj[0] == VERSION
            and isinstance(obj[1], list) and isinstance(obj[2], list)):
        raise ProtocolError(f"tensor-list header of unknown layout or version: {obj!r:.120}")
    meta, specs = obj[1], obj[2]
    if not all(_uint(v) for v in meta):
        raise ProtocolError(f"tensor-list metadata must be non-negative integers: {meta!r:.120}")
    out, total = [], 0
    for spec in specs:
        if not (isinstance(spec, list) and 1 <= len(spec) <= MAX_NDIM + 1 and all(_uint(v) for v in spec)
                and spec[0] in dtypes.NAMES and math.prod(spec[1:]) <= MAX_DIM):
            raise ProtocolError(f"bad tensor spec in header: {spec!r:.120}")
        dtype = dtypes.BY_NAME[dtypes.NAMES[spec[0]]]
        total += math.prod(spec[1:]) * dtype.itemsize
        out.append((dtype, tuple(spec[1:])))
    if total > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"tensor-list header claims {total} bytes of payload (at most {MAX_MESSAGE_BYTES})")
    return tuple(meta), out


def allocate(specs: list[tuple[torch.dtype, tuple[int, ...]]], src: int) -> list[torch.Tensor]:
    """The receive buffers a decoded header asks for; memory the process cannot get is the
    message's fault (a ProtocolError naming the sender), not an untyped allocator error."""
    try:
        return [torch.empty(shape, dtype=dtype) for dtype, shape in specs]
    except (RuntimeError, MemoryError) as exc:
        total = sum(math.prod(shape) * dtype.itemsize for dtype, shape in specs)
        raise ProtocolError(f"tensor-list header from rank {src} asks for {total} bytes, which this "
                            f"process cannot allocate: {exc}".splitlines()[0]) from None


def _uint(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_DIM


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


class SendHandle:
    """The works of one tensor-list send; keeps the sent memory alive until they complete."""

    def __init__(self, works: list, keep: list[torch.Tensor]):
        self.works, self._keep = works, keep

    def wait(self) -> None:
        for w in self.works:
            if w is not None:
                w.wait()
        self._keep = []

    def is_completed(self) -> bool:
        return all(w is None or w.is_completed() for w in self.works)


def isend_tensors(tensors: list[torch.Tensor], dst: int, group=None, tag: int = 0,
                  meta: tuple[int, ...] = ()) -> SendHandle:
    """Post the header and every payload to ``dst`` (global rank); returns at once."""
    sent = [t.detach().contiguous() for t in tensors]
    header = torch.frombuffer(bytearray(encode_header(sent, meta)), dtype=torch.uint8)
    works = [dist.isend(header, dst, group, tag)]
    works += [dist.isend(_bytes(t), dst, group, tag) for t in sent if t.numel()]
    return SendHandle(works, [header, *sent])


def recv_tensors(src: int, group=None, tag: int = 0) -> tuple[tuple[int, ...], list[torch.Tensor]]:
    """Receive one tensor list from ``src``: (meta, tensors). Blocks within the group's deadline;
    a dead peer is the transport's PeerLost."""
    header = torch.empty(HEADER_BYTES, dtype=torch.uint8)
    dist.irecv(header, src, group, tag).wait()
    meta, specs = decode_header(header.numpy().tobytes())
    out = allocate(specs, src)
    works = [dist.irecv(_bytes(t), src, group, tag) for t in out if t.numel()]
    for w in works:
        w.wait()
    return meta, out


@dataclass
class P2POp:
    """One transfer for batch_isend_irecv, as in torch: ``P2POp(commrt.isend, tensor, peer)``."""
    op: Callable
    tensor: torch.Tensor
    peer: int
    group: object = None
    tag: int = 0

    def __post_init__(self):
        if self.op not in (dist.isend, dist.irecv):
            raise ValueError(f"P2POp.op must be commrt.isend or commrt.irecv, got {self.op!r}")


def batch_isend_irecv(p2p_op_list: list[P2POp]) -> list:
    """Post every send and receive of the list, then return their works (torch's contract): on
    zmq one progress thread serves them all, so the order of the list never deadlocks."""
    if not p2p_op_list:
        raise ValueError("batch_isend_irecv needs at least one P2POp")
    return [p.op(p.tensor, p.peer, p.group, p.tag) for p in p2p_op_list]
