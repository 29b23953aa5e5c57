"""Shared-memory segments between the ranks of one node, and the step counter that orders them.

Each rank of a group creates one segment: a control page (a step counter, the header of the
operation each slot holds, attach marks from its peers) and two data slots. A collective runs
in steps; step ``t`` writes into this rank's slot ``t % 2``, publishes ``t`` in its counter and
waits until every peer has published ``t``, then reads the peers' slot ``t % 2`` in place. A
peer that has published ``t + 1`` has finished reading step ``t - 1``, so a rank may write slot
``(t + 1) % 2`` as soon as its wait at ``t`` returns: one synchronisation per step, never two.
Stores become visible in program order on x86-64 (TSO): data is written before the counter,
so a peer that sees the counter sees the data. Other architectures keep the TCP path.

Safety: a segment is an anonymous memory file (segments.py) that exists nowhere in the file
system; its descriptor reaches only peers that proved the job secret on this rank's handoff
socket (handoff.py), and its memory goes with the last process that maps it. What a peer
writes in its control page is validated like a wire header: it is compared, never used as a
size or index.
"""
from __future__ import annotations

import mmap
import os
import time

import sys

import numpy as np
import zmq

from commrt.runtime.errors import GroupClosed, PeerLost
from commrt.transport import notices
from commrt.transport.wire import ABORT, COLL, REFUSE
from commrt.transport.endpoint import Endpoint
from commrt.transport.segments import (CTL_BYTES, MAGIC, SLOT_BYTES, attach, close_fd, create, node_key,
    reserve, segment_bytes, supported)

__all__ = ["Channel", "yield_window", "watch_peers", "HDR_WORDS", "W_COUNTER", "ATTACH_BASE",  # segments too:
           "CTL_BYTES", "MAGIC", "SLOT_BYTES", "attach", "close_fd", "create", "node_key",  # shm.create etc.
           "reserve", "segment_bytes", "supported"]

W_COUNTER = 1  # word 0 is the magic (segments.W_MAGIC)
W_REFUSED = 2  # the last op this rank refused on its own input (its seq), written before its next step
HDR_BASE, HDR_WORDS = 8, 8  # per slot: step, seq, op, dtype, count, reduce, root, aux
ATTACH_BASE = 64  # attach marks: word ATTACH_BASE + r is set by group rank r
MAX_RANKS = CTL_BYTES // 8 - ATTACH_BASE
SPIN_CHECKS = 64  # busy checks (a few microseconds) before yielding the core
YIELD_S = 0.0002  # then sched_yield for this long (a peer a few microseconds behind: issue 17)
CROWDED_YIELD_S = 0.00005  # the same when the node's ranks outnumber its cores (see yield_window)
SHORT_NAPS_S = 0.002  # then the shortest sleep (the timer slack, ~55 us here) until this long
MIN_NAP_S, MAX_NAP_S = 1e-6, 0.001  # then naps doubling up to MAX_NAP_S
MAX_CACHED_VIEWS = 64  # (dtype, size, slot) view lists a channel keeps for small ops


def yield_window(ranks: int, cores: int) -> float:
    """How long a wait keeps yielding the core before it sleeps. When ranks outnumber cores, a
    yielding rank still takes turns on a core that a rank with work needs (sched_yield only
    skips it once): it sleeps sooner there."""
    return YIELD_S if ranks <= cores else CROWDED_YIELD_S


def watch_peers(ep: Endpoint, waiting: list[int], op: str, seq: int, now: float | None = None) -> None:
    """PeerLost, if one of ``waiting`` is gone, naming the peer that went first (Liveness.lost):
    not a rank that said goodbye, whose connection dropped because it left on purpose."""
    now = time.monotonic() if now is None else now
    ep.watch_peers()
    for p in waiting:
        if ep.live.is_lost(p, now):
            raise ep.live.lost(p, op, seq, now)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class Channel:
    """The mapped segments of one group's ranks on one node (index = group rank), and the
    step protocol over them. One owner at a time, like the Endpoint whose sockets watch the
    peers' liveness and carry their ABORT notices."""

    def __init__(self, ep: Endpoint, maps: list[mmap.mmap], names: list[str], slot_bytes: int,
                 grace_s: float):
        """``names``: each rank's handoff socket name (for messages and tests)."""
        self.ep, self.rank, self.size = ep, ep.rank, len(maps)
        self.slot_bytes, self.names, self._maps = slot_bytes, names, maps
        self.rings: dict = {}  # peer -> the point-to-point rings handed over with the segments
        self._grace_s = grace_s
        self.ctl = [memoryview(m)[:CTL_BYTES].cast("q") for m in maps]
        self.raw = [np.frombuffer(m, dtype=np.uint8, offset=CTL_BYTES) for m in maps]  # data, as bytes
        self._data: list | None = None  # the same as torch tensors, made when a tensor op needs them
        self._slots: dict = {}  # numpy dtype -> per rank, its two slots as arrays of that dtype
        self._rows: dict = {}  # (dtype, numel, slot) -> rows(): every rank's row in rank 0's slot
        # per rank and slot, a live view of its header's words but aux: comparing two such views
        # is one C call (a small op at 8 ranks compares seven)
        self._hdr = [[c[HDR_BASE + HDR_WORDS * s:HDR_BASE + HDR_WORDS * (s + 1) - 1] for s in (0, 1)]
                     for c in self.ctl]
        self._peers = [(p, self.ctl[p]) for p in range(self.size) if p != self.rank]
        self._peer_hdr = [[(p, self._hdr[p][s]) for p, _ in self._peers] for s in (0, 1)]
        self._peer_ctl = [c for _, c in self._peers]
        self.t = 0  # last step this rank published
        self._yield_s = yield_window(self.size, _cores())

    def attach_all(self) -> None:
        """Mark every peer's segment attached and wait for their marks on ours: every rank then
        knows that its peers map the very memory it maps (the handoff passed that memory)."""
        for _, c in self._peers:
            c[ATTACH_BASE + self.rank] = 1
        mine = self.ctl[self.rank]
        self._wait(lambda: [p for p, _ in self._peers if mine[ATTACH_BASE + p] != 1], "connect", 0)

    def begin(self, header) -> int:
        """Start the next step: write its header (HDR_WORDS int64, an array('q') whose first
        word this sets to the step) into this rank's slot; returns the slot."""
        t = self.t + 1
        slot = t & 1
        base = HDR_BASE + HDR_WORDS * slot
        header[0] = t
        self.ctl[self.rank][base:base + HDR_WORDS] = header  # one copy, not a store per word
        return slot

    @property
    def data(self) -> list:
        """The data regions as torch uint8 tensors, for tensor ops (bfloat16 views): made on first
        use, so a rank that moves only numpy buffers never needs torch (issue 32.2)."""
        if self._data is None:
            torch = sys.modules["torch"]  # loaded: a tensor op asked
            self._data = [torch.from_numpy(a) for a in self.raw]
        return self._data

    def slots(self, dtype: np.dtype) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per rank, its two data slots as numpy arrays of ``dtype`` (made once per dtype):
        slicing these costs a fraction of a torch view, which matters for small payloads."""
        views = self._slots.get(dtype)
        if views is None:
            n = self.slot_bytes // dtype.itemsize
            views = self._slots[dtype] = [
                (a[:self.slot_bytes].view(dtype)[:n], a[self.slot_bytes:2 * self.slot_bytes].view(dtype)[:n])
                for a in self.raw]
        return views

    def rows(self, dtype: np.dtype, numel: int, slot: int) -> tuple[np.ndarray, list[np.ndarray]] | None:
        """The small all-reduce's parts side by side: every rank's row of ``numel`` elements in
        group rank 0's ``slot`` (rows 64-byte aligned), as one 2-D array and as a view per rank.
        Each rank writes its row there, so reducing every rank's part is one numpy call over
        the array, not one per peer. None where the rows do not fit in a slot. The views are
        kept for the sizes a program repeats (a few dozen at most): a small op makes none."""
        key = (dtype, numel, slot)
        got = self._rows.get(key)
        if got is None:
            row = -(-numel * dtype.itemsize // 64) * 64
            if row * self.size > self.slot_bytes:
                return None
            if len(self._rows) >= MAX_CACHED_VIEWS:
                self._rows.clear()
            every = np.ndarray((self.size, numel), dtype, buffer=self.raw[0], offset=slot * self.slot_bytes,
                               strides=(row, dtype.itemsize))
            got = self._rows[key] = (every, list(every))
        return got

    def publish_and_wait(self, op: str, seq: int) -> None:
        self.t = t = self.t + 1
        self.ctl[self.rank][W_COUNTER] = t  # after the data: see the module's note on ordering
        peers = self._peer_ctl
        for _ in range(SPIN_CHECKS):
            for c in peers:
                if c[W_COUNTER] < t:
                    break
            else:
                return
        self._wait(lambda: [p for p, c in self._peers if c[W_COUNTER] < t], op, seq)

    def count(self, peer: int, op: int, nbytes: int) -> None:
        """Account ``nbytes`` that ``peer`` reads from our segment as sent to it, like the
        socket path's counters (the bench's and comm_stats' intra-node bytes)."""
        self.ep.count_sent(peer, COLL, op, nbytes)

    def count_all(self, op: int, nbytes: int) -> None:
        """``count`` for every peer of the group."""
        self.ep.count_sent_to_all(COLL, op, nbytes)

    def header(self, p: int, slot: int) -> list[int]:
        base = HDR_BASE + HDR_WORDS * slot
        return self.ctl[p][base:base + HDR_WORDS].tolist()

    def mismatched_peer(self, slot: int) -> int | None:
        """The first peer whose header in ``slot`` differs from this rank's in any word but
        aux, or None: one comparison of two live views per peer (seven at 8 ranks)."""
        mine = self._hdr[self.rank][slot]
        for p, h in self._peer_hdr[slot]:
            if h != mine:
                return p
        return None

    def _wait(self, pending, op: str, seq: int) -> None:
        """Until ``pending()`` is empty: yield the core while the wait is short (most waits
        of small ops end within microseconds), then sleep, in growing naps past SHORT_NAPS_S;
        the peers' liveness, ABORT notices and the deadline are checked once a slice (as
        Endpoint.recv), after the spin has failed, never per check."""
        ep = self.ep
        start = time.monotonic()
        deadline, extended, nap, watched = start + ep.timeout_s, False, 0.0, start
        while True:
            waiting = pending()
            if not waiting:
                return
            now = time.monotonic()
            if ep.cancelled:
                raise GroupClosed(ep.group, op, seq)
            if now - watched >= ep.live.slice_s:
                watched = now
                self._watch(waiting, op, seq, now)
            if now >= deadline:
                if not ep.down and not extended:  # let the heartbeats name a frozen peer first
                    deadline, extended = now + 4 * self._grace_s, True
                    continue
                gone = sorted((p for p in ep.down if p not in ep.live.gone), key=ep.down.get) or waiting
                raise PeerLost(gone[0], op, seq, f"timeout after {ep.timeout_s:g}s: rank {waiting[0]} did not "
                               f"reach step {self.t} (shared memory)")
            if now - start < self._yield_s:  # not time.sleep(0): that sleeps for the timer slack
                os.sched_yield()
            elif now - start < SHORT_NAPS_S:
                time.sleep(MIN_NAP_S)
            else:
                nap = min(MAX_NAP_S, max(2e-5, nap * 2))
                time.sleep(nap)

    def mark_refused(self, seq: int) -> None:
        """This rank refused operation ``seq``: a peer that meets this rank's next step where
        it expected ``seq`` (the REFUSE notice may still be on its way) can tell why."""
        self.ctl[self.rank][W_REFUSED] = seq

    def refused_by(self, p: int) -> int:
        """The last op rank ``p`` refused (0: none)."""
        return self.ctl[p][W_REFUSED]

    def _watch(self, waiting: list[int], op: str, seq: int, now: float) -> None:
        watch_peers(self.ep, waiting, op, seq, now)
        self.read_notices(op, seq)

    def read_notices(self, op: str, seq: int) -> None:
        """What the peers said on the socket (ABORT, REFUSE), without waiting: raises on one
        that ends ``op``."""
        ep = self.ep
        while (msg := ep.read(zmq.NOBLOCK)) is not None:
            h = msg.header
            if h.kind == REFUSE:
                notices.refused(ep, msg, op, seq)
                continue
            if h.kind == ABORT:  # nothing else travels on a shared-memory group's collective socket
                notices.aborted(ep, msg, op, seq)

    def close(self) -> None:
        """Unmap every segment (the memory goes once no peer maps it either)."""
        for v in (v for views in self._hdr for v in views):
            v.release()
        for v in self.ctl:
            v.release()
        self._hdr, self.ctl, self._data, self.raw, self._peers, self._peer_ctl = [], [], None, [], [], []
        self._slots, self._rows, self._peer_hdr = {}, {}, []
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # a tensor view still exported: the mapping goes with the process
                pass
