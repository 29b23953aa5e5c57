"""OpContext: what one running collective needs to talk to its peers, with every incoming
message checked against what this rank is running (so divergent programs fail loudly)."""
from __future__ import annotations

import enum
import warnings
from dataclasses import dataclass, field

import torch

from .. import dtypes
from ..errors import CollectiveMismatch
from ..transport import Endpoint
from ..wire import COLL, Header

# torch.frombuffer warns on read-only buffers; ZeroMQ's receive buffers are read-only by
# design and we only ever read them.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


class Coll(enum.IntEnum):
    """Collective codes on the wire."""
    ALL_REDUCE = 1
    REDUCE_SCATTER = 2
    ALL_GATHER = 3
    BROADCAST = 4
    REDUCE = 5
    ALL_TO_ALL = 6
    BARRIER = 7


_NAMES = {c: c.name.lower() for c in Coll}


def _as_bytes(t: torch.Tensor):
    """Zero-copy uint8 numpy view of a contiguous 1-D tensor (works for bfloat16 too)."""
    return t.view(torch.uint8).numpy() if t.numel() else b""


@dataclass
class OpContext:
    ep: Endpoint
    group: int
    rank: int
    size: int
    seq: int
    coll: Coll
    dtype: torch.dtype
    count: int
    piece_bytes: int
    small_bytes: int
    site: int = 0  # hash of the calling source line (check_call_sites), 0 when not checked
    # per-op constants, set once (this object is built on every call: keep it cheap)
    name: str = field(init=False)
    itemsize: int = field(init=False)
    piece_elems: int = field(init=False)
    _op: int = field(init=False)
    _code: int = field(init=False)
    _sent: list = field(init=False)
    _recvd: list = field(init=False)

    def __post_init__(self) -> None:
        self.name = _NAMES[self.coll]
        self.itemsize = self.dtype.itemsize
        self.piece_elems = max(1, self.piece_bytes // self.itemsize)
        self._op = int(self.coll) | self.site << 8
        self._code = dtypes.code_of(self.dtype)
        self._sent = [0] * self.size
        self._recvd = [0] * self.size

    def header(self, nbytes: int, step: int) -> Header:
        return Header(COLL, self.group, self.seq, self.rank, self._op, self._code, self.count, step, nbytes)

    def send(self, dst: int, data: torch.Tensor | None = None) -> None:
        payload = b"" if data is None else _as_bytes(data)
        step = self._sent[dst]
        self._sent[dst] = step + 1
        self.ep.send(dst, self.header(len(payload), step), payload, op=self.name)

    def recv(self, src: int, numel: int = 0) -> torch.Tensor:
        """Next piece from ``src``, as a read-only tensor view of the received frame."""
        payload = self.recv_buffer(src, numel)
        if numel == 0:
            return torch.empty(0, dtype=self.dtype)
        return torch.frombuffer(payload, dtype=self.dtype)

    def recv_buffer(self, src: int, numel: int) -> memoryview:
        """Next piece from ``src``, checked against this op, as the received frame's bytes."""
        msg = self.ep.recv(src, op=self.name, seq=self.seq)
        step = self._recvd[src]
        self._recvd[src] = step + 1
        h, want = msg.header, self.header(numel * self.itemsize, step)
        if (h.kind, h.seq, h.op, h.dtype, h.count) != (want.kind, want.seq, want.op, want.dtype, want.count):
            raise CollectiveMismatch(self.name, self.seq, self._describe(want), self._describe(h),
                                     peer=src, rank=self.rank)
        if (h.step, h.nbytes) != (want.step, want.nbytes):
            raise CollectiveMismatch(
                self.name, self.seq, {**self._describe(want), "step": step, "bytes": want.nbytes},
                {**self._describe(h), "step": h.step, "bytes": h.nbytes}, peer=src, rank=self.rank)
        return msg.payload.buffer

    @staticmethod
    def _describe(h: Header) -> dict:
        code, site = h.op & 0xFF, h.op >> 8
        op = Coll(code).name.lower() if code in Coll._value2member_map_ else f"op{code}"
        out = {"seq": h.seq, "op": op, "dtype": dtypes.name_of(h.dtype), "count": h.count}
        if site:
            out["call site"] = f"{site:06x}"
        return out

    def flush(self) -> None:
        self.ep.flush(self.name, self.seq)
