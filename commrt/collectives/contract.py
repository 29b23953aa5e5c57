"""The step contract: what a collective's context is, whichever path carries its steps.

A collective runs over one context per call: ``OpContext`` (context.py) sends pieces over
the group's sockets, ``ShmContext`` (shm_context.py) runs steps over the node's shared memory.
Both are an ``OpShape`` (the op's identity, from which every header is made) and implement
``StepContext``; the algorithms over each (ops.py, shm_ops.py) implement ``Algorithms`` with
the same signatures, and run behind aliasing.py's rules, so the two paths cannot disagree
about what an op is, how a mismatch is described, or what may alias what (issue 28.3).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from commrt.runtime import dtypes
from commrt.runtime.errors import CollectiveMismatch
from commrt.transport.messages import MismatchReport
from commrt.transport.wire import COLL, Coll, Header
from commrt.collectives.reduce_ops import ReduceOp

NAMES = {c: c.name.lower() for c in Coll}
_REDUCING = (Coll.ALL_REDUCE, Coll.REDUCE_SCATTER, Coll.REDUCE)
_ROOTED = (Coll.BROADCAST, Coll.REDUCE)


@runtime_checkable
class StepContext(Protocol):
    """What the backend, the errors and the algorithms read of any context (the rest of its
    identity is in its header)."""
    name: str
    rank: int
    size: int
    seq: int
    itemsize: int
    refused: tuple[Header, Header] | None  # after a mismatch: (what this rank ran, what it read)

    def header(self, nbytes: int, step: int, src: int | None = None) -> Header: ...


class Algorithms(Protocol):
    """The collectives over one kind of context; each buffer (numpy array or tensor) is flat, and
    outputs are disjoint from inputs or in NCCL's in-place form (aliasing.py sees to it)."""

    def all_reduce(self, ctx: Any, flat, op: ReduceOp) -> None: ...

    def reduce_scatter(self, ctx: Any, out, inp, op: ReduceOp) -> None: ...

    def all_gather(self, ctx: Any, out, inp) -> None: ...

    def broadcast(self, ctx: Any, flat, src: int) -> None: ...

    def reduce(self, ctx: Any, flat, dst: int, op: ReduceOp) -> None: ...

    def all_to_all(self, ctx: Any, out, inp,
                   out_bounds: list[tuple[int, int]], in_bounds: list[tuple[int, int]]) -> None: ...

    def barrier(self, ctx: Any) -> None: ...


@dataclass
class OpShape:
    """One operation's identity, the part both contexts share. ``link`` is what its steps
    go through (an Endpoint or a shared-memory Channel); subclasses add ``site``, ``reduce``,
    ``root`` and ``declared`` (the caller's dtype, which headers name, where the op runs on a
    wider copy: backends.base.widened; None: ``dtype``) and call ``_derive`` once built."""
    link: Any
    group: int
    rank: int
    size: int
    seq: int
    coll: Coll
    dtype: Any  # the buffers' dtype: numpy's or torch's (runtime/arrays.py)
    count: int

    def _derive(self) -> None:
        """The per-op constants, set once (a context is built or renewed on every call)."""
        self.name = NAMES[self.coll]
        self.itemsize = self.dtype.itemsize
        self.reduce = int(self.reduce)  # a ReduceOp is an IntEnum: the wire takes plain ints
        self._op = int(self.coll) | self.site << 8
        self._code = dtypes.code_of(self.dtype if self.declared is None else self.declared)

    def header(self, nbytes: int, step: int, src: int | None = None) -> Header:
        return Header(COLL, self.group, self.seq, self.rank if src is None else src, self._op,
                      self._code, self.count, step, nbytes, self.reduce, self.root)


def describe(h: Header) -> dict:
    """A header as the fields a mismatch error shows."""
    code, site = h.op & 0xFF, h.op >> 8
    coll = Coll(code) if code in Coll._value2member_map_ else None
    out = {"seq": h.seq, "op": coll.name.lower() if coll else f"op{code}",
           "dtype": dtypes.name_of(h.dtype), "count": h.count}
    if coll in _REDUCING:
        out["reduce"] = ReduceOp(h.reduce).name if h.reduce in ReduceOp._value2member_map_ else h.reduce
    if coll in _ROOTED:
        out["root"] = h.root
    if h.group:
        out["group"] = h.group
    if site:
        out["call site"] = f"{site:06x}"
    return out


def restate_report(report: MismatchReport, ctx: StepContext) -> CollectiveMismatch:
    """A peer saw ranks disagree: ``report.mine`` is what the reporter ran, ``report.theirs``
    what it received from rank ``theirs.src``. The error names the side that differs from what
    this rank runs (the culprit), against this rank's own op. The rank whose message was refused
    is told the reporter's side (its own header is not the culprit, even when it matches its
    current op: the same op with other piece sizes, or an op it ran before). If neither side
    matches, the report is passed on as is."""
    own = ctx.header(0, 0)
    key = lambda h: (h.seq, h.op, h.dtype, h.count, h.reduce, h.root)
    same = lambda h: key(h) == key(own)
    a, b = report.mine, report.theirs
    if b.src == ctx.rank:
        mine, culprit, rank = b, a, ctx.rank
    elif same(a) != same(b):
        mine, culprit, rank = own, (b if same(a) else a), ctx.rank
    else:
        mine, culprit, rank = a, b, a.src
    ours, theirs = describe(mine), describe(culprit)
    if ours == theirs:  # the same op, other piece boundaries: show them (as OpContext does)
        ours.update(step=mine.step, bytes=mine.nbytes)
        theirs.update(step=culprit.step, bytes=culprit.nbytes)
    return CollectiveMismatch(ctx.name, ctx.seq, ours, theirs, peer=culprit.src, rank=rank,
                              reported_by=report.reporter)
