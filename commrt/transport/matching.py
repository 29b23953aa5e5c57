"""Which posted receive an arriving point-to-point message belongs to (no sockets, no threads).

Receives from one peer wait per (source, tag) in posting order; a receive from any source
(``ANY_SOURCE``) waits per tag. A message goes to its (source, tag)'s first receive, unless a
receive from any source posted before that one is waiting (MPI's matching order): that receive
then belongs to the sender, at the front of its queue, and takes this message and the rest of
its pieces. A message no receive wants is kept with its arrival number, so a later receive from
any source takes the earliest. Receive sequence numbers count completed receives per (source,
tag), which is what the sender's numbering of its sends to us means: a failed or expired
receive keeps its number, so a message numbered at or below the receives already done is the
rest of one that failed (a receive too small for it fails on its first piece) or one that came
after its receive expired, and goes to nobody (it would fail the next receive, and that one's
message the next). A receive waits ``timeout_s`` from when it became the first of its queue
with a message for the one before it. The progress engine (p2p.py) owns one of these; only its
thread touches it.
"""
from __future__ import annotations

import collections
import logging
from dataclasses import dataclass
from typing import Any, Callable

from commrt.runtime.errors import CollectiveMismatch, PeerLost

log = logging.getLogger("commrt.transport.p2p")

ANY_SOURCE = -1  # Recv.src of a receive from any peer, until a message binds it to one


@dataclass
class Recv:
    src: int
    tag: int
    seq: int
    code: int
    count: int
    pieces: list  # one writable destination per expected piece
    land: Callable  # land(piece, frame): copy a received frame into its piece
    done: Callable | None  # after the last piece (write-back), or None
    work: Any  # the caller's Work handle (work.py, a layer above): _finish / is_completed
    got: int = 0
    since: float = 0.0
    order: int = 0  # posting order, between receives from one peer and from any


class Matching:
    def __init__(self, rank: int, bind: Callable[[int], Any], release: Callable[[Any], None],
                 clock: Callable[[], float]):
        """``bind(src)``: a receive now waits on ``src`` (the engine watches its connection);
        ``release(msg)``: a message's payload is no longer needed (a ring hands its space back);
        ``clock()``: now, for a receive's last progress."""
        self._rank, self._on_bind, self._release, self._clock = rank, bind, release, clock
        self.recvs: dict[tuple[int, int], collections.deque] = collections.defaultdict(collections.deque)
        self.any: dict[int, collections.deque] = collections.defaultdict(collections.deque)  # by tag
        self.early: dict[tuple[int, int], collections.deque] = collections.defaultdict(collections.deque)
        self.early_bytes: collections.Counter = collections.Counter()  # kept per source
        self.early_msgs: collections.Counter = collections.Counter()  # kept per source (empty ones too)
        self._arrivals = self._posts = 0
        self._removed: collections.Counter = collections.Counter()  # receives done per (src, tag)
        self._dropped: tuple | None = None  # (src, tag, seq) of the last message dropped

    def post(self, op) -> None:
        """A new receive (``Recv``); takes what was kept for it."""
        self._posts += 1
        op.order = self._posts
        if op.src == ANY_SOURCE:
            self.any[op.tag].append(op)
            self._any_take_early(op.tag)
        else:
            self._on_bind(op.src)
            key = (op.src, op.tag)
            self.recvs[key].append(op)
            if self.early.get(key):  # what came before it (most receives are posted first)
                self._match_early(op)

    def arrive(self, msg) -> bool:
        """Land ``msg`` in the receive it belongs to; False when none is posted (keep or drop it)."""
        h = msg.header
        key = (h.src, h.op)
        if h.seq <= self._removed[key]:
            self._drop(msg)
            return True
        waiting = self.recvs.get(key)
        anyq = self.any.get(h.op)
        if anyq and not (waiting and (waiting[0].got or waiting[0].order < anyq[0].order)):
            self._bind(anyq.popleft(), h.src)
            if anyq:  # a message with this tag came: the next receive from any waits from now
                anyq[0].since = max(anyq[0].since, self._clock())
            waiting = self.recvs[key]
        if not waiting:
            return False
        self._land(waiting, msg)
        return True

    def keep(self, msg) -> int:
        """Keep a message no receive wants yet; returns the bytes now kept from its sender."""
        h = msg.header
        self._arrivals += 1
        self.early[(h.src, h.op)].append((self._arrivals, msg))
        self.early_bytes[h.src] += h.nbytes
        self.early_msgs[h.src] += 1
        return self.early_bytes[h.src]

    def drop_early(self, src: int) -> None:
        for k in [k for k in self.early if k[0] == src]:
            for _, dropped in self.early.pop(k):
                self._release(dropped)
        self.early_bytes[src] = self.early_msgs[src] = 0

    def pop(self, waiting: collections.deque):
        """Remove a (source, tag) queue's first receive: done, failed or expired. Its number is
        used: what is kept of its message goes (the rest of it is dropped as it comes)."""
        op = waiting.popleft()
        key = (op.src, op.tag)
        self._removed[key] += 1
        early = self.early.get(key)
        while early and early[0][1].header.seq <= self._removed[key]:
            self.early_bytes[op.src] -= early[0][1].header.nbytes
            self.early_msgs[op.src] -= 1
            self._drop(early.popleft()[1])
        return op

    def _drop(self, msg) -> None:
        """A piece of a message whose receive failed or expired (its number is used)."""
        h = msg.header
        if self._dropped != (h.src, h.op, h.seq):  # once a message, not once a piece
            self._dropped = (h.src, h.op, h.seq)
            log.warning("rank %d: dropped (what is left of) message %d from rank %d with tag %d: its receive "
                        "failed or expired", self._rank, h.seq, h.src, h.op)
        self._release(msg)

    def overdue(self, now: float, timeout_s: float, live) -> list:
        """Remove and return [(receive, PeerLost)] for the first receive of each queue whose sender
        is lost (``live``: transport/liveness.py) or that saw no progress for ``timeout_s``."""
        out = []
        for waiting in self.recvs.values():
            op = waiting[0] if waiting else None
            if op is None:
                continue
            if live.is_lost(op.src, now):
                out.append((self.pop(waiting), live.lost(op.src, "recv", op.seq, now)))
            elif now - op.since > timeout_s:
                out.append((self.pop(waiting), PeerLost(op.src, "recv", op.seq,
                                                        f"timeout after {timeout_s:g}s: no message from it")))
        gone = {p for p in live.down if live.is_lost(p, now)}
        for tag, waiting in self.any.items():
            op = waiting[0] if waiting else None
            if op is None:
                continue
            if gone:  # a possible sender died: it may be the one we wait for (as MPI ULFM; issue 30.11)
                error = PeerLost(min(gone, key=live.down.get), "recv", op.seq, f"its connection is lost (lost: "
                                 f"ranks {sorted(gone)}, the first named) and it may be the sender of this "
                                 f"receive from any source (tag {tag})")
            elif now - op.since > timeout_s:
                error = PeerLost(ANY_SOURCE, "recv", op.seq, f"no message with tag {tag} from any rank "
                                 f"within {timeout_s:g}s", role="any peer")
            else:
                continue
            out.append((waiting.popleft(), error))
        return out

    def _bind(self, op, src: int) -> None:
        op.src = src
        self._on_bind(src)
        self.recvs[(src, op.tag)].appendleft(op)

    def _any_take_early(self, tag: int) -> None:
        waiting = self.any[tag]
        while waiting:
            heads = [(q[0][0], k) for k, q in self.early.items() if k[1] == tag and q]
            if not heads:
                return
            op = waiting.popleft()
            self._bind(op, min(heads)[1][0])
            self._match_early(op)

    def _match_early(self, op) -> None:
        early = self.early.get((op.src, op.tag))
        waiting = self.recvs[(op.src, op.tag)]
        while early and waiting and waiting[0] is op:
            _, msg = early.popleft()
            self.early_bytes[op.src] -= msg.header.nbytes
            self.early_msgs[op.src] -= 1
            self._land(waiting, msg)

    def _land(self, waiting: collections.deque, msg) -> None:
        op, h = waiting[0], msg.header
        op.seq = self._removed[(op.src, op.tag)] + 1
        want = (op.seq, op.code, op.count, op.got, op.pieces[op.got].nbytes if op.got < len(op.pieces) else -1)
        error = None
        try:
            if (h.seq, h.dtype, h.count, h.step, h.nbytes) != want:
                error = CollectiveMismatch("recv", op.seq, {"tag": op.tag, "seq": op.seq, "dtype code": op.code,
                                                           "count": op.count, "step": op.got},
                                           {"tag": h.op, "seq": h.seq, "dtype code": h.dtype,
                                            "count": h.count, "step": h.step}, peer=op.src, rank=self._rank)
            else:
                op.land(op.pieces[op.got], msg.payload)
                op.got += 1
        except BaseException as exc:  # it fails this receive only
            error = exc
        finally:
            self._release(msg)
        op.since = self._clock()
        if error is None and op.got < len(op.pieces):
            return
        self.pop(waiting)  # once, before anything of the caller's runs
        if waiting:  # its sender moved: the next receive waits from now
            waiting[0].since = max(waiting[0].since, op.since)
        if error is None and op.done is not None:
            try:
                op.done()  # the write-back into a non-contiguous or device tensor
            except BaseException as exc:
                error = exc
        try:  # the result: who sent it (a receive from any source asks)
            op.work._finish(None if error is not None else op.src, error)
        except Exception:  # a done-callback's own failure (torch's futures log theirs too)
            log.exception("rank %d: a done-callback of a receive from rank %d failed", self._rank, op.src)
