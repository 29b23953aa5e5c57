"""Running a ``schedules.py`` schedule on the TCP path: one rank's steps over an OpContext.

A step sends a chunk range, receives one, and applies what it received (reduce into, or copy
over, the own range). Ranges name chunks of ``bounds`` modulo their number (Bruck wraps), so a
range becomes one or two contiguous element spans, cut into pieces of ``ctx.piece_elems`` as the
ring's are; both sides cut them alike, so every piece's size is known to its receiver and the
header check catches any disagreement. A step whose range holds no element still sends one empty
message: the barrier's steps are nothing else, and a schedule's message count stays what the
schedule says (comm_stats counts it).

Buffer rule (ops.py): ZeroMQ reads pieces of 1 MiB and more after ``send`` returns, and a
step's send reads the buffer as it was before its receive is applied (recursive doubling sends
and reduces the same range). So before writing a span this rank has sent since the last flush,
the executor flushes; below 1 MiB nothing is tracked and the flush returns at once.
"""
from __future__ import annotations

from typing import NamedTuple

from commrt.runtime.arrays import address
from commrt.collectives.algorithms import pieces
from commrt.collectives.context import OpContext
from commrt.collectives.reduce_ops import ReduceOp, combine_into, copy_
from commrt.collectives.schedules import COPY, REDUCE, Step

Bounds = list[tuple[int, int]]


class Side(NamedTuple):
    """One buffer and its chunks: what a step's send reads, or its receive writes."""
    buf: object  # a flat numpy array or tensor
    bounds: Bounds


def spans(rng: tuple[int, int], bounds: Bounds) -> list[tuple[int, int]]:
    """Chunks ``rng`` (modulo ``len(bounds)``) as contiguous, non-empty element ranges."""
    out: list[tuple[int, int]] = []
    parts = len(bounds)
    for c in range(*rng):
        a, b = bounds[c % parts]
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return [s for s in out if s[1] > s[0]]


def step_pieces(rng: tuple[int, int], bounds: Bounds, piece_elems: int) -> list[tuple[int, int]]:
    """The messages one step's range travels as: its pieces, or one empty message."""
    return [p for s in spans(rng, bounds) for p in pieces(*s, piece_elems)] or [(0, 0)]


class _Sent:
    """Element ranges handed to ZeroMQ since the last flush: writing one waits for a flush."""

    def __init__(self, ctx: OpContext, buf):
        self.ctx, self.buf, self.ptr, self.ranges = ctx, buf, address(buf), []

    def note(self, view, a: int, b: int) -> None:
        # only the buffer written later matters (``is`` first: a numpy address costs ~1 us)
        if b > a and (view is self.buf or address(view) == self.ptr):
            self.ranges.append((a, b))

    def before_write(self, a: int, b: int) -> None:
        if any(lo < b and a < hi for lo, hi in self.ranges):
            self.ctx.flush()
            self.ranges.clear()


def _apply(step: Step, dst, incoming, op: ReduceOp | None) -> None:
    if step.action == REDUCE:
        if step.received_left:  # the lower block of ranks is the left operand (schedules.py)
            combine_into(dst, incoming, dst, op)
        else:
            combine_into(dst, dst, incoming, op)
    elif step.action == COPY:
        copy_(dst, incoming)


def run(ctx: OpContext, steps: list[Step], send: Side, recv: Side | None = None,
        op: ReduceOp | None = None, sends_first: bool = False) -> None:
    """Run ``steps``: sends read ``send``, receives write ``recv`` (default: the same buffer).
    ``sends_first``: no send depends on a receive (pairwise all_to_all), so all are queued at
    once and the receives follow, one network latency instead of one per step."""
    recv = send if recv is None else recv
    sent, pe = _Sent(ctx, recv.buf), ctx.piece_elems
    order = ([(s, True, False) for s in steps] + [(s, False, True) for s in steps] if sends_first
             else [(s, True, True) for s in steps])
    for step, do_send, do_recv in order:
        if do_send and step.send_to is not None:
            for a, b in step_pieces(step.send, send.bounds, pe):
                ctx.send(step.send_to, send.buf[a:b])
                sent.note(send.buf, a, b)
        if do_recv and step.recv_from is not None:
            for a, b in step_pieces(step.recv, recv.bounds, pe):
                incoming = ctx.recv(step.recv_from, b - a)
                if b > a:
                    sent.before_write(a, b)
                    _apply(step, recv.buf[a:b], incoming, op)
