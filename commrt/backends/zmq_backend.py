"""Our backend: the ring collectives over ZeroMQ/TCP, one Endpoint and Executor per group."""
from __future__ import annotations

import collections
import functools
import logging
import sys
import threading
import zlib
from typing import Callable

import torch

from commrt.runtime import dtypes
from commrt.collectives import ops, shm_ops
from commrt.collectives.aliasing import Aliased
from commrt.collectives.context import Coll, Journal, OpContext
from commrt.collectives.contract import NAMES as _NAMES, describe
from commrt.collectives.shm_ops import ShmContext
from commrt.collectives.reduce_ops import ReduceOp, copy_
from commrt.runtime.config import Config
from commrt.runtime.errors import (CollectiveMismatch, CommError, ConfigError, GroupClosed, PeerLost,
    ProtocolError)
from commrt.transport import shm
from commrt.transport import Endpoint, Transport
from commrt.transport.endpoint import MismatchReport, encode_report
from commrt.transport.memory import keep_freed_memory
from commrt.transport.p2p import ANY_SOURCE, P2PEngine, Recv, Send
from commrt.transport.wire import P2P, Header
from commrt.runtime.work import CommTimeout, Executor, Work
from commrt.backends.base import check_same_dtype, flat_view, split_bounds
from commrt.backends.staging import Staged

log = logging.getLogger(__name__)

STAGE_PIECES = 4  # a staged all_reduce piece is this many pipelining chunks
READ_AHEAD_OPS = 4  # ops a peer may be ahead beyond those this rank has issued
READ_AHEAD_FLOOR = 64 << 20  # bytes; a flood beyond the bound breaks the group (issue 13.10)
MAX_CACHED_CONTEXTS = 64  # op shapes whose shared-memory context a group keeps
TCP_OPS, SHM_OPS = Aliased(ops), Aliased(shm_ops)  # both paths behind the one set of aliasing rules


def _call_site() -> int:
    """24-bit hash of the first caller outside commrt (file and line)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("commrt."):
        frame = frame.f_back
    where = f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else "?"
    return (zlib.crc32(where.encode()) & 0xFFFFFF) or 1


class ZmqBackend:
    name = "zmq"

    def __init__(self, transport: Transport, cfg: Config, rank: int, size: int, group_id: int,
                 members: list[int] | None = None):
        """``members``: the global rank of each group rank (the names their keys carry)."""
        self.rank, self.size, self.group_id, self.cfg = rank, size, group_id, cfg
        c, cl = cfg.comm, cfg.cluster
        if c.keep_freed_memory:
            keep_freed_memory()
        names = [f"rank{g}" for g in (members if members is not None else range(size))]
        make = lambda: Endpoint(transport, group_id, rank, names, cl.bind_host, cl.advertise_host,
                                c.max_frame_bytes, c.heartbeat_s, c.timeout_s)
        self._coll, p2p = make(), make()
        self._p2p = P2PEngine(p2p, c.timeout_s)
        self._p2p_address = p2p.address
        self._p2p_ep = p2p
        self._exec = Executor(f"group{group_id}")
        self._seq = 0  # of the last collective started (assigned when it starts, in issue order)
        self._journal = Journal()  # recent ops, so a stray message's error names both sides
        self._p2p_seq: collections.Counter = collections.Counter()
        self._p2p_lock = threading.Lock()  # a transfer's number and its posting are one step
        self._broken: BaseException | None = None
        self._largest = 0  # bytes of the largest collective so far
        self._pending = [0, 0]  # (ops, bytes) submitted and not finished: the read-ahead budget
        self._ops = TCP_OPS  # SHM_OPS once connect() finds every member on this rank's node
        self._shm: shm.Channel | None = None
        self._shm_contexts: dict = {}  # op shape -> its ShmContext (see _shm_context)
        self._segment = make_segment(c.intra_node)  # (name, mapping) or None

    @property
    def addresses(self) -> list[str]:
        seg = f"shm:{shm.node_key()}:{self._segment[0]}" if self._segment else "shm:-"
        return [self._coll.address, self._p2p_address, seg]

    def connect(self, table: list[list[str]]) -> None:
        """``table[r]`` is rank r's ``addresses``; sockets are dialled when first needed."""
        self._coll.connect({r: a[0] for r, a in enumerate(table)})
        self._p2p_ep.connect({r: a[1] for r, a in enumerate(table)})
        self._connect_shm([a[2] if len(a) > 2 else "shm:-" for a in table])

    def _connect_shm(self, entries: list[str]) -> None:
        """Shared memory when every member published a segment on this rank's node (every rank
        sees the same table, so all decide alike); otherwise our segment goes at once."""
        seg, self._segment = self._segment, None
        names = [e.rsplit(":", 1)[-1] for e in entries]
        if seg is None or self.size == 1 or len({e.rsplit(":", 1)[0] for e in entries}) != 1 or "-" in names:
            if seg is not None:
                shm.unlink(seg[0])
                seg[1].close()
            return
        maps = []
        try:
            for p, name in enumerate(names):
                maps.append(seg[1] if p == self.rank else shm.attach(name, shm.SLOT_BYTES))
            for p in range(self.size):  # their connections' monitors tell us a peer died
                if p != self.rank:
                    self._coll.socket_to(p)
            self._shm = shm.Channel(self._coll, maps, names, shm.SLOT_BYTES, self.cfg.comm.heartbeat_s)
            self._shm.attach_all()
        except BaseException:
            for name in names:  # a peer killed before its peers attached leaves nothing behind
                shm.unlink(name)
            if self._shm is not None:
                self._shm.close()
            self._shm = None
            raise
        self._verify_peers()
        self._ops = SHM_OPS
        self._p2p.use_shm(set(range(self.size)) - {self.rank})  # large p2p payloads through rings too

    def _verify_peers(self) -> None:
        """One barrier over the authenticated sockets before any data goes through shared memory.
        The segments' names come from the address exchange, and under torch.distributed's store
        (commrt/tdist) nobody authenticated that: a rank without the job's secret (or CURVE key)
        must fail here, as it would on the TCP path, not share our memory."""
        channel, self._shm = self._shm, None
        try:
            self.barrier()
        except BaseException:
            channel.close()
            raise
        self._shm = channel

    # -- running an operation ----------------------------------------------------------------
    def _collective(self, coll: Coll, dtype: torch.dtype, count: int,
                    body: Callable[[OpContext], None], async_op: bool,
                    writeback: Callable[[], None] | None = None, nbytes: int | None = None, *,
                    reduce: int = 0, root: int = 0) -> Work | None:
        self._check_usable()
        site = _call_site() if self.cfg.comm.check_call_sites else 0
        nbytes = count * dtype.itemsize if nbytes is None else nbytes
        run = functools.partial(self._run, coll, dtype, count, body, writeback, site, nbytes, reduce, root)
        if async_op:
            self._budget(1, nbytes)
            try:
                return self._exec.submit(_NAMES[coll], run)
            except BaseException:
                self._budget(-1, -nbytes)
                raise
        self._budget(1, nbytes)
        try:
            self._exec.run(_NAMES[coll], run, self.cfg.comm.timeout_s)
        except CommTimeout as exc:
            # gave up before starting (no seq used), behind work that stopped progressing: the
            # peers may run this op; the group cannot be trusted any more
            self._broken = exc
            self._budget(-1, -nbytes)
            raise
        return None

    def _run(self, coll, dtype, count, body, writeback, site, nbytes, reduce, root) -> None:
        """One collective, holding the executor's turn (this thread owns the sockets)."""
        try:
            self._check_usable()
            self._seq += 1
            c = self.cfg.comm
            if self._shm is not None:
                ctx = self._shm_context(coll, dtype, count, site, reduce, root)
            else:
                ctx = OpContext(self._coll, self.group_id, self.rank, self.size, self._seq, coll, dtype,
                                count, c.chunk_bytes, c.small_bytes, site, reduce, root, self._journal)
            try:
                body(ctx)
            except (PeerLost, CollectiveMismatch, ProtocolError, MismatchReport) as exc:
                raise self._give_up(exc, ctx) from None
            if writeback is not None:
                writeback()
        finally:
            self._budget(-1, -nbytes)

    def _shm_context(self, coll, dtype, count, site, reduce, root) -> ShmContext:
        """The op's context over shared memory. Programs repeat a few op shapes: a context is
        kept per shape and given the new sequence number (ops of a group run one at a time),
        which saves building one per call (a few microseconds on a small op)."""
        key = (coll, dtype, count, site, reduce, root)
        ctx = self._shm_contexts.get(key)
        if ctx is None:
            if len(self._shm_contexts) >= MAX_CACHED_CONTEXTS:
                self._shm_contexts.clear()
            ctx = self._shm_contexts[key] = ShmContext(self._shm, self.group_id, self.rank, self.size, self._seq,
                                                       coll, dtype, count, site, reduce, root,
                                                       self.cfg.comm.small_bytes)
        else:
            ctx.renew(self._seq)
        return ctx

    def _budget(self, ops: int, nbytes: int) -> None:
        """How far a peer may legitimately be ahead, per peer: all the bytes of every op this
        rank has issued and not finished (all of an op can reach us early: all_to_all, a
        reduce root) plus a few ops not issued here yet, sized like the largest op so far
        (programs repeat their ops), never less than READ_AHEAD_FLOOR."""
        if self._shm is not None:  # no collective data arrives on the socket: nothing to bound
            return
        p = self._pending
        p[0] += ops
        p[1] += nbytes
        self._largest = max(self._largest, nbytes)
        c = self.cfg.comm
        ahead = p[1] + max(READ_AHEAD_OPS * max(self._largest, c.chunk_bytes), READ_AHEAD_FLOOR)
        pieces = ahead // max(1, min(c.chunk_bytes, c.small_bytes)) + 1
        self._coll.ahead_limit = (pieces + (p[0] + READ_AHEAD_OPS) * (self.size + 8), ahead)

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise CommError(f"group {self.group_id} is unusable after an earlier failure: {self._broken}")

    def _give_up(self, exc: BaseException, ctx: OpContext) -> BaseException:
        """The stream is out of step with the peers: no later op could be trusted. Tell every
        peer why (once, by the rank that saw it), so the whole group fails at once alike."""
        if isinstance(exc, MismatchReport):
            exc = restate_report(exc, ctx)
        elif isinstance(exc, PeerLost):
            self._coll.tell_peers(ctx.seq, lost=exc.rank)
        elif isinstance(exc, CollectiveMismatch) and exc.reported_by is None and self._coll.last is not None:
            self._coll.tell_peers(ctx.seq, report=encode_report(ctx.header(0, 0), self._coll.last))
        self._broken = exc
        return exc

    # -- collectives ---------------------------------------------------------------------------
    def all_reduce(self, tensor, op=ReduceOp.SUM, async_op=False):
        t = dtypes.as_tensor(tensor)
        if t.is_cuda:  # pieces staged through pinned memory, copies overlapping the network
            staged = Staged(t, STAGE_PIECES * self.cfg.comm.chunk_bytes)
            return self._collective(Coll.ALL_REDUCE, t.dtype, t.numel(),
                                    lambda ctx: staged.run(lambda piece: self._ops.all_reduce(ctx, piece, op)),
                                    async_op, reduce=op)
        flat, wb = flat_view(tensor)
        return self._collective(Coll.ALL_REDUCE, flat.dtype, flat.numel(),
                                lambda ctx: self._ops.all_reduce(ctx, flat, op), async_op, wb, reduce=op)

    def reduce_scatter_tensor(self, output, input, op=ReduceOp.SUM, async_op=False):
        out, wb = flat_view(output, "output")
        inp, _ = flat_view(input, "input")
        check_same_dtype(out, inp, "reduce_scatter_tensor")
        if inp.numel() != out.numel() * self.size:
            raise ValueError(f"reduce_scatter_tensor: input has {inp.numel()} elements, expected "
                             f"output ({out.numel()}) x world size ({self.size})")
        return self._collective(Coll.REDUCE_SCATTER, out.dtype, inp.numel(),
                                lambda ctx: self._ops.reduce_scatter(ctx, out, inp, op), async_op, wb, reduce=op)

    def all_gather_into_tensor(self, output, input, async_op=False):
        out, wb = flat_view(output, "output")
        inp, _ = flat_view(input, "input")
        check_same_dtype(out, inp, "all_gather_into_tensor")
        if out.numel() != inp.numel() * self.size:
            raise ValueError(f"all_gather_into_tensor: output has {out.numel()} elements, expected "
                             f"input ({inp.numel()}) x world size ({self.size})")
        return self._collective(Coll.ALL_GATHER, out.dtype, out.numel(),
                                lambda ctx: self._ops.all_gather(ctx, out, inp), async_op, wb)

    def broadcast(self, tensor, src, async_op=False):
        flat, wb = flat_view(tensor)
        return self._collective(Coll.BROADCAST, flat.dtype, flat.numel(),
                                lambda ctx: self._ops.broadcast(ctx, flat, src), async_op, wb, root=src)

    def reduce(self, tensor, dst, op=ReduceOp.SUM, async_op=False):
        flat, wb = flat_view(tensor)
        return self._collective(Coll.REDUCE, flat.dtype, flat.numel(),
                                lambda ctx: self._ops.reduce(ctx, flat, dst, op), async_op, wb, reduce=op, root=dst)

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None,
                          async_op=False):
        o, i = dtypes.as_tensor(output), dtypes.as_tensor(input)
        out, wb = flat_view(o, "output")
        inp, _ = flat_view(i, "input")
        check_same_dtype(out, inp, "all_to_all_single")
        out_b = split_bounds(out.numel(), o.shape[0] if o.dim() else 1, output_split_sizes, self.size, "output")
        in_b = split_bounds(inp.numel(), i.shape[0] if i.dim() else 1, input_split_sizes, self.size, "input")
        return self._collective(Coll.ALL_TO_ALL, out.dtype, 0,
                                lambda ctx: self._ops.all_to_all(ctx, out, inp, out_b, in_b), async_op, wb,
                                nbytes=max(inp.numel(), out.numel()) * out.element_size())

    def barrier(self, async_op=False):
        return self._collective(Coll.BARRIER, torch.uint8, 0, lambda ctx: self._ops.barrier(ctx), async_op)

    # -- point to point ------------------------------------------------------------------------
    def isend(self, tensor, dst: int, tag: int = 0) -> Work:
        flat, _, code, steps = self._p2p_plan(tensor, "send", dst, tag)
        with self._p2p_lock:
            seq = self._next_p2p("send", dst, tag)
            frames = []
            for step, piece in enumerate(steps):
                payload = piece.view(torch.uint8).numpy() if piece.numel() else b""
                frames.append((Header(P2P, self.group_id, seq, self.rank, tag, code, flat.numel(), step,
                                      len(payload)), payload))
            return self._p2p.post(Send(dst, tag, seq, frames, Work("send")))

    def irecv(self, tensor, src: int | None, tag: int = 0) -> Work:
        """``src`` None: from any peer; the Work's result is the sender's group rank."""
        src = ANY_SOURCE if src is None else src
        flat, wb, code, steps = self._p2p_plan(tensor, "recv", src, tag)
        with self._p2p_lock:
            seq = self._next_p2p("recv", src, tag)
            return self._p2p.post(Recv(src, tag, seq, code, flat.numel(), steps, _land, wb, Work("recv")))

    def _p2p_plan(self, tensor, direction: str, peer: int, tag: int):
        """(flat, write-back, dtype code, pieces) of one point-to-point transfer."""
        self._check_usable()
        if not (0 <= peer < self.size or peer == ANY_SOURCE and direction == "recv") or peer == self.rank:
            raise ValueError(f"{direction}: peer rank {peer} is invalid (rank {self.rank} of {self.size})")
        if tag < 0:
            raise ValueError(f"{direction}: tag must be >= 0, got {tag}")
        flat, wb = flat_view(tensor)
        pe = max(1, self.cfg.comm.chunk_bytes // flat.element_size())
        steps = [flat[a:a + pe] for a in range(0, max(flat.numel(), 1), pe)]
        return flat, wb, dtypes.code_of(flat.dtype), steps

    def _next_p2p(self, direction: str, peer: int, tag: int) -> int:
        key = (direction, peer, tag)
        self._p2p_seq[key] += 1
        return self._p2p_seq[key]

    def close(self, timeout_s: float = 10.0) -> bool:
        """Cancel work in flight (waiters get GroupClosed) and close the sockets once their
        owners have stopped. Returns False if an owner did not stop in time: its sockets are
        then left to the process's exit rather than closed under it (which aborts libzmq)."""
        self._coll.cancel()
        closed = lambda name: GroupClosed(self.group_id, name, None)
        coll_stopped = self._exec.close(closed, timeout_s)
        p2p_stopped = self._p2p.close(timeout_s)
        if self._segment is not None:  # made, never connected
            shm.unlink(self._segment[0])
        if coll_stopped:
            if self._shm is not None:
                self._shm.close()
            self._coll.close()
        else:
            log.warning("group %d: an operation did not stop within %gs; leaving its sockets open",
                        self.group_id, timeout_s)
        return coll_stopped and p2p_stopped


def make_segment(mode: str):
    """This rank's shared-memory segment for ``[comm] intra_node`` (None: TCP only)."""
    if mode == "tcp":
        return None
    why = shm.supported()
    if why is None:
        try:
            return shm.create(shm.SLOT_BYTES)
        except OSError as exc:
            why = f"cannot create a segment in {shm.SHM_DIR}: {exc}"
    if mode == "shm":
        raise ConfigError(f"[comm] intra_node = 'shm' cannot be used here: {why}")
    log.info("intra-node traffic stays on TCP: %s", why)
    return None


def _land(piece: torch.Tensor, frame) -> None:
    if piece.numel():
        copy_(piece, torch.frombuffer(frame.buffer, dtype=piece.dtype))


def restate_report(report: MismatchReport, ctx: OpContext) -> CollectiveMismatch:
    """A peer saw ranks disagree. Name the side that differs from what this rank runs (the
    culprit), against this rank's own op; if neither side matches, pass the report on as is."""
    own = ctx.header(0, 0)
    key = lambda h: (h.seq, h.op, h.dtype, h.count, h.reduce, h.root)
    same = lambda h: key(h) == key(own)
    a, b = report.mine, report.theirs
    if same(a) or same(b):
        mine, culprit, rank = own, (b if same(a) else a), ctx.rank
    else:
        mine, culprit, rank = a, b, a.src
    return CollectiveMismatch(ctx.name, ctx.seq, describe(mine), describe(culprit),
                              peer=culprit.src, rank=rank, reported_by=report.reporter)
