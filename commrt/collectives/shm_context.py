"""ShmContext: what one running collective over shared memory (transport/shm.py) needs, for a
group whose ranks share a node; shm_ops.py's algorithms run over it. It implements
contract.StepContext, as context.OpContext does over the group's sockets.

A step (``begin``, then ``exchange``) writes this rank's part into its slot, waits until every
peer has published the same step, and checks the peers' headers against this op, so divergent
programs fail loudly; the algorithms then read the peers' slots in place (``view``).
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import numpy as np

from commrt.runtime.errors import CollectiveMismatch, OpRefused
from commrt.transport.shm import HDR_WORDS, Channel
from commrt.transport.wire import COLL, Coll, Header
from commrt.collectives.contract import NAMES, OpShape, describe as _describe
from commrt.collectives.reduce_ops import numpy_dtype


@dataclass
class ShmContext(OpShape):
    """``link`` is the group's shared-memory Channel (also as ``chan``)."""
    site: int = 0
    reduce: int = 0
    root: int = 0
    small_bytes: int = 0  # all_reduce up to this size runs in one step
    declared: object = None  # the caller's dtype, named in the headers (contract.OpShape)
    # per-op constants, set once (this object is built on every call: keep it cheap)
    name: str = field(init=False)
    itemsize: int = field(init=False)
    slot_elems: int = field(init=False)
    np_dtype: np.dtype | None = field(init=False)  # None: no numpy type (bfloat16)
    _words: tuple = field(init=False)
    _header: array = field(init=False)  # step, *_words, aux: what begin() publishes
    _slot: int = field(init=False)
    refused: tuple | None = field(init=False, default=None)  # (ours, theirs) of a mismatch: as OpContext

    def __post_init__(self) -> None:
        self._derive()
        self.chan: Channel = self.link
        self.slot_elems = self.chan.slot_bytes // self.itemsize
        self.np_dtype = numpy_dtype(self.dtype)
        self._raw = isinstance(self.dtype, np.dtype)  # a numpy op: views of the slots are numpy's
        self._words = (self.seq, self._op, self._code, self.count, self.reduce, self.root)
        self._header = array("q", (0, *self._words, 0))
        self._slot = 0

    def renew(self, seq: int) -> None:
        """The same op shape again, as operation ``seq`` (what every field derives from seq)."""
        self.seq = seq
        self._words = (seq, *self._words[1:])
        self._header[1] = seq

    def begin(self, aux: int = 0) -> int:
        """Start a step; returns its slot, whose data this rank may now write."""
        self._header[HDR_WORDS - 1] = aux
        self._slot = self.chan.begin(self._header)
        return self._slot

    def exchange(self) -> None:
        """Publish the step and wait for every peer; check their headers against this op."""
        chan, slot = self.chan, self._slot
        chan.publish_and_wait(self.name, self.seq)
        p = chan.mismatched_peer(slot)  # one loop over live views of the headers, nothing built
        if p is not None:
            h = chan.header(p, slot)
            if h[:-1] != [chan.t, *self._words]:  # ours in shared memory is [chan.t, *self._words]
                raise self._mismatch(p, h)

    def _mismatch(self, p: int, h: list[int]) -> CollectiveMismatch | OpRefused:
        refused = self.chan.ep.refused_here.get(h[1])
        if refused is not None and h[1] != self.seq:  # p started the op this rank refused: it gave up
            return OpRefused(self.rank, NAMES[Coll(refused[0])], h[1], refused[1], reported_by=p)
        if h[1] > self.seq and self.chan.refused_by(p) >= self.seq:
            # p refused this op and went on faster than its notice travels: read it if it is here
            self.chan.read_notices(self.name, self.seq)
            return OpRefused(p, self.name, self.seq, f"its reason is in rank {p}'s own error")
        theirs = Header(COLL, self.group, h[1], p, h[2], h[3], h[4], 0, 0, h[5], h[6])
        self.refused = (self.header(0, 0), theirs)
        mine, other = _describe(self.header(0, 0)), _describe(theirs)
        if h[0] != self.chan.t and mine == other:
            mine["step"], other["step"] = self.chan.t, h[0]
        return CollectiveMismatch(self.name, self.seq, mine, other, peer=p, rank=self.rank)

    def sent(self, p: int, numel: int) -> None:
        """``numel`` of this rank's elements that rank ``p`` reads (the transport's counters)."""
        if numel:
            self.chan.count(p, self._words[1], numel * self.itemsize)

    def sent_to_all(self, numel: int) -> None:
        """``numel`` of this rank's elements that every peer reads."""
        self.chan.count_all(self._words[1], numel * self.itemsize)

    def view(self, p: int, slot: int, start: int, numel: int):
        """Elements [start, start + numel) of rank p's slot, as this op's dtype: a numpy array
        for a numpy op, a tensor for a tensor op (numpy's and torch's ``view`` read alike)."""
        a = slot * self.chan.slot_bytes + start * self.itemsize
        return (self.chan.raw if self._raw else self.chan.data)[p][a:a + numel * self.itemsize].view(self.dtype)
