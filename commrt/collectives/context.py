"""OpContext: what one running collective needs to talk to its peers over the group's sockets,
with every incoming message checked against what this rank is running (so divergent programs
fail loudly). It implements contract.StepContext, as shm_context.ShmContext does over shared memory."""
from __future__ import annotations

from dataclasses import dataclass, field

from commrt.runtime.arrays import as_bytes, empty_of, frombuffer, numel as numel_of
from commrt.runtime.errors import CollectiveMismatch
from commrt.transport import Endpoint
from commrt.transport.wire import Coll, Header
from commrt.collectives.contract import NAMES as _NAMES, OpShape, describe as _describe
from commrt.collectives.selection import DEFAULT_TABLE, Rule, choose

__all__ = ["Coll", "Journal", "OpContext", "_NAMES", "_describe"]  # _NAMES: obs/stats.py reads it


class Journal:
    """The last few operations one group ran, by sequence number. Ranks that disagree about a
    broadcast's root can all believe they are the root: each only sends, and the disagreement
    shows as a stray message at the group's next operation. The journal lets that error name
    what both sides ran at the stray's sequence number (issue 13.5)."""
    SIZE = 64

    def __init__(self) -> None:
        self._ops: list = [None] * self.SIZE

    def record(self, ctx: "OpContext") -> None:
        self._ops[ctx.seq % self.SIZE] = ctx

    def find(self, seq: int) -> "OpContext | None":
        ctx = self._ops[seq % self.SIZE]
        return ctx if ctx is not None and ctx.seq == seq else None


def _as_bytes(t):
    """Zero-copy uint8 numpy view of a flat array or tensor (a bfloat16 tensor's too)."""
    return as_bytes(t) if numel_of(t) else b""


@dataclass
class OpContext(OpShape):
    """``link`` is the group's collective Endpoint (also as ``ep``)."""
    piece_bytes: int
    small_bytes: int
    site: int = 0  # hash of the calling source line (check_call_sites), 0 when not checked
    reduce: int = 0  # ReduceOp code of a reducing collective, else 0
    root: int = 0  # broadcast's source / reduce's destination (group rank), else 0
    journal: Journal | None = None  # the group's recent operations, for naming stray messages
    table: tuple[Rule, ...] = DEFAULT_TABLE  # which schedule runs which size (selection.py, [comm] algorithms)
    # all_to_all (whose op count is 0): per peer, the block length this rank sends it and the one
    # it expects from it, as each piece's header count. Pieces alone let a longer block pass when
    # the expected one ends on a piece boundary: the op completed, the stray came at the next op
    blocks: tuple[list[int], list[int]] | None = None
    declared: object = None  # the caller's dtype, named in the headers (contract.OpShape)
    # per-op constants, set once (this object is built on every call: keep it cheap)
    name: str = field(init=False)
    itemsize: int = field(init=False)
    piece_elems: int = field(init=False)
    _op: int = field(init=False)
    _code: int = field(init=False)
    _sent: list = field(init=False)
    _recvd: list = field(init=False)
    # (what this rank ran, what arrived) once a message did not match: the report its peers get
    refused: tuple[Header, Header] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self._derive()
        self.ep: Endpoint = self.link
        self.piece_elems = max(1, self.piece_bytes // self.itemsize)
        self._sent = [0] * self.size
        self._recvd = [0] * self.size
        if self.journal is not None:
            self.journal.record(self)

    def algorithm(self, collective: str, nbytes: int) -> str:
        """The schedule the table names for ``collective`` moving ``nbytes`` on this group."""
        return choose(collective, nbytes, self.size, self.table)

    def send(self, dst: int, data=None) -> None:
        payload = b"" if data is None else _as_bytes(data)
        step = self._sent[dst]
        self._sent[dst] = step + 1
        h = self.header(len(payload), step)
        if self.blocks is not None:
            h = h._replace(count=self.blocks[0][dst])
        self.ep.send(dst, h, payload, op=self.name)

    def recv(self, src: int, numel: int = 0):
        """Next piece from ``src``, as a view of the received frame of the op's buffer type
        (numpy array or tensor; read it only). No copy and no warning: pyzmq frames export a
        writable buffer, so torch.frombuffer has nothing to warn about
        (tests/unit/test_no_side_effects.py keeps it so)."""
        payload = self.recv_buffer(src, numel)
        return frombuffer(payload, self.dtype) if numel else empty_of(0, self.dtype)

    def recv_buffer(self, src: int, numel: int) -> memoryview:
        """Next piece from ``src``, checked against this op, as the received frame's bytes."""
        msg = self.ep.recv(src, op=self.name, seq=self.seq)
        step = self._recvd[src]
        self._recvd[src] = step + 1
        h, want = msg.header, self.header(numel * self.itemsize, step, src)
        if self.blocks is not None:
            want = want._replace(count=self.blocks[1][src])
        if h != want:
            raise self._mismatch(src, h, want)
        return msg.payload.buffer

    def _mismatch(self, src: int, h: Header, want: Header) -> CollectiveMismatch:
        """The error for an unexpected message; both sides described with what differs."""
        if h.seq < self.seq and self.journal is not None and self.journal.find(h.seq) is not None:
            # a stray left over from an earlier op that src ran differently: name that op
            earlier = self.journal.find(h.seq)
            self.refused = (earlier.header(0, 0), h)
            mine = {**_describe(earlier.header(0, 0)), "noticed at": f"seq {self.seq} ({self.name})"}
            return CollectiveMismatch(earlier.name, h.seq, mine, _describe(h), peer=src, rank=self.rank)
        self.refused = (want._replace(src=self.rank), h)
        mine, theirs = _describe(want), _describe(h)
        if mine == theirs:  # same op, other piece boundaries: show them
            mine.update(step=want.step, bytes=want.nbytes)
            theirs.update(step=h.step, bytes=h.nbytes)
        return CollectiveMismatch(self.name, self.seq, mine, theirs, peer=src, rank=self.rank)

    def flush(self) -> None:
        self.ep.flush(self.name, self.seq)
