"""Our backend: the ring collectives over ZeroMQ/TCP, one Endpoint and Executor per group."""
from __future__ import annotations

import functools
import logging
import sys
import zlib
from typing import Callable

from commrt.collectives import ops, shm_ops
from commrt.collectives.aliasing import Aliased
from commrt.collectives.context import Coll, Journal, OpContext
from commrt.collectives.contract import NAMES as _NAMES, restate_report
from commrt.collectives.selection import table_from
from commrt.collectives.shm_ops import ShmContext
from commrt.runtime.config import Config
from commrt.runtime.config.comm import parse_algorithms
from commrt.runtime.errors import CollectiveMismatch, CommError, GroupClosed, OpRefused, PeerLost, ProtocolError
from commrt.transport import shm
from commrt.transport import Endpoint, Transport
from commrt.transport.endpoint import MismatchReport, encode_report
from commrt.transport.memory import keep_freed_memory
from commrt.transport.p2p import P2PEngine
from commrt.runtime.work import CommTimeout, Executor, Work
from commrt.backends.zmq_calls import CollectiveCalls
from commrt.backends.zmq_p2p import PointToPoint
from commrt.backends.zmq_shm import make_segment, open_channel, shares_memory

log = logging.getLogger(__name__)

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


class ZmqBackend(CollectiveCalls):
    name = "zmq"

    def __init__(self, transport: Transport, cfg: Config, rank: int, size: int, group_id: int,
                 members: list[int] | None = None):
        """``members``: the global rank of each group rank (the names their keys carry)."""
        self.rank, self.size, self.group_id, self.cfg = rank, size, group_id, cfg
        self._members = members
        c, cl = cfg.comm, cfg.cluster
        if c.keep_freed_memory:
            keep_freed_memory()
        names = [f"rank{g}" for g in (members if members is not None else range(size))]
        make = lambda: Endpoint(transport, group_id, rank, names, cl.bind_host, cl.advertise_host,
                                c.max_frame_bytes, c.heartbeat_s, c.timeout_s)
        self._coll, p2p = make(), make()
        self._p2p = P2PEngine(p2p, c.timeout_s, members)
        self._pt = PointToPoint(self._p2p, group_id, rank, size, c.chunk_bytes)
        self._p2p_address = p2p.address
        self._p2p_ep = p2p
        self._exec = Executor(f"group{group_id}")
        self._seq = 0  # of the last collective started (assigned when it starts, in issue order)
        self._journal = Journal()  # recent ops, so a stray message's error names both sides
        self._table = table_from(parse_algorithms(c.algorithms))  # which schedule runs what ([comm] algorithms)
        self._broken: BaseException | None = None
        self._largest = 0  # bytes of the largest collective so far
        self._pending = [0, 0]  # (ops, bytes) submitted and not finished: the read-ahead budget
        self._ops = TCP_OPS  # SHM_OPS once connect() finds every member on this rank's node
        self._shm: shm.Channel | None = None
        self._shm_contexts: dict = {}  # op shape -> its ShmContext (see _shm_context)
        self._segment = make_segment(c.intra_node, c.shm_slot_bytes)  # a zmq_shm.LocalSegment or None

    @property
    def addresses(self) -> list[str]:
        seg = f"shm:{shm.node_key()}:{self._segment.name}" if self._segment else "shm:-"
        return [self._coll.address, self._p2p_address, seg]

    def connect(self, table: list[list[str]]) -> None:
        """``table[r]`` is rank r's ``addresses``; sockets are dialled when first needed."""
        self._coll.connect({r: a[0] for r, a in enumerate(table)})
        self._p2p_ep.connect({r: a[1] for r, a in enumerate(table)})
        self._connect_shm([a[2] if len(a) > 2 else "shm:-" for a in table])

    def connect_lazy(self, fetch: Callable) -> None:
        """Addresses learnt when a peer is first dialled: ``fetch(peers, op, lost)`` gives rank
        p's ``addresses`` for each of ``peers`` (issue 32.5). For a group whose members do not
        all share this node's memory (``needs_every_address`` was False), so no shared memory."""
        self._coll.connect({}, lambda peers, op, lost: {p: a[0] for p, a in fetch(peers, op, lost).items()})
        self._p2p_ep.connect({}, lambda peers, op, lost: {p: a[1] for p, a in fetch(peers, op, lost).items()})
        self._connect_shm(["shm:-"] * self.size)

    @staticmethod
    def needs_every_address(table: list[list[str]]) -> bool:
        """Whether ``connect`` needs every member's ``addresses`` at once: shared memory
        connects to every member at init."""
        return shares_memory([a[2] if len(a) > 2 else "shm:-" for a in table])

    @property
    def broken(self) -> BaseException | None:
        """The failure that made this group unusable, if any."""
        return self._broken

    def _connect_shm(self, entries: list[str]) -> None:
        """Shared memory when every member is on this rank's node (zmq_shm.open_channel)."""
        seg, self._segment = self._segment, None
        self._shm = open_channel(self._coll, seg, entries, self.cfg.comm.heartbeat_s)
        if self._shm is None:
            return
        self._verify_peers()
        self._ops = SHM_OPS
        self._p2p.use_shm(self._shm.rings)  # large p2p payloads through the rings handed over too

    def _verify_peers(self) -> None:
        """One barrier over the authenticated sockets before any data goes through shared memory.
        The handoff sockets' names come from the address exchange, and under torch.distributed's store
        (commrt/tdist) nobody authenticated that: a rank without the job's secret (or CURVE key)
        must fail here, as it would on the TCP path, not share our memory."""
        channel, self._shm = self._shm, None
        try:
            self.barrier()
        except BaseException:
            for out, inn in channel.rings.values():  # not handed to the p2p engine yet: ours to close
                out.close()
                inn.close()
            channel.close()
            raise
        self._shm = channel

    # -- running an operation ----------------------------------------------------------------
    def _collective(self, coll: Coll, dtype, count: int,
                    body: Callable[[OpContext], None], async_op: bool,
                    writeback: Callable[[], None] | None = None, nbytes: int | None = None, *,
                    reduce: int = 0, root: int = 0, declared=None) -> Work | None:
        """``declared``: the caller's dtype where ``dtype`` is a wider copy's (widened)."""
        if self._broken is not None:
            self._check_usable()
        site = _call_site() if self.cfg.comm.check_call_sites else 0
        nbytes = count * dtype.itemsize if nbytes is None else nbytes
        if self._shm is None:  # the read-ahead budget bounds what arrives on the socket
            self._budget(1, nbytes)
        if async_op:
            try:
                return self._exec.submit(_NAMES[coll], functools.partial(
                    self._run, coll, dtype, count, body, writeback, site, nbytes, reduce, root, declared))
            except BaseException:
                self._budget(-1, -nbytes)
                raise
        try:
            self._exec.run(_NAMES[coll], self._run, self.cfg.comm.timeout_s,
                           coll, dtype, count, body, writeback, site, nbytes, reduce, root, declared)
        except CommTimeout as exc:
            # gave up before starting (no seq used), behind work that stopped progressing: the
            # peers may run this op; the group cannot be trusted any more
            self._broken = exc
            self._budget(-1, -nbytes)
            raise
        return None

    def _run(self, coll, dtype, count, body, writeback, site, nbytes, reduce, root, declared) -> None:
        """One collective, holding the executor's turn (this thread owns the sockets)."""
        try:
            if self._broken is not None:
                self._check_usable()
            self._seq += 1
            if self._shm is not None:
                ctx = self._shm_context(coll, dtype, count, site, reduce, root, declared)
            else:
                c = self.cfg.comm
                ctx = OpContext(self._coll, self.group_id, self.rank, self.size, self._seq, coll, dtype,
                                count, c.chunk_bytes, c.small_bytes, site, reduce, root, self._journal,
                                self._table, declared=declared)
            try:
                if self._coll.refusals:  # a peer refused this op before we began it
                    refusal = self._coll.refusal_at(self._seq)
                    if refusal is not None:
                        raise refusal
                body(ctx)
            except (PeerLost, CollectiveMismatch, ProtocolError, MismatchReport, OpRefused) as exc:
                raise self._give_up(exc, ctx) from None
            if writeback is not None:
                writeback()
        finally:
            if self._shm is None:
                self._budget(-1, -nbytes)

    def _refused(self, coll: Coll, exc: BaseException, async_op: bool) -> BaseException:
        """Input this rank refuses (a ValueError or TypeError while preparing its buffers) takes
        the op's place in the sequence and is told to the peers, which would otherwise wait in
        the op until the deadline (``OpRefused`` there); returns ``exc`` for the caller to raise.
        (A try block, not a context manager: free on the path every op takes.)"""
        if self._broken is None:
            run = functools.partial(self._refuse, coll, f"{type(exc).__name__}: {exc}")
            try:
                if async_op:
                    self._exec.submit(_NAMES[coll], run)
                else:
                    self._exec.run(_NAMES[coll], run, self.cfg.comm.timeout_s)
            except CommError as failed:  # the group went away meanwhile: the input's error stands
                log.warning("rank %d: refusal of %s not told: %s", self.rank, _NAMES[coll], failed)
                if isinstance(failed, CommTimeout):  # as in _collective: the seq was not taken
                    self._broken = failed
        return exc

    def refuse(self, op: str, exc: BaseException, async_op: bool = False) -> BaseException:
        """The caller's own refusal of this group's collective ``op`` ("broadcast", ...), e.g. the
        front door's of a root outside the group: told to the peers as ``_refused`` does."""
        return self._refused(Coll[op.upper()], exc, async_op)

    def _refuse(self, coll: Coll, reason: str) -> None:
        """Holding the executor's turn: the refused op's sequence number, and the notices."""
        self._seq += 1
        if self._shm is not None:
            self._shm.mark_refused(self._seq)
        self._coll.refuse(self._seq, int(coll), reason)

    def _shm_context(self, coll, dtype, count, site, reduce, root, declared=None) -> ShmContext:
        """The op's context over shared memory. Programs repeat a few op shapes: a context is
        kept per shape and given the new sequence number (ops of a group run one at a time),
        which saves building one per call (a few microseconds on a small op)."""
        key = (coll, dtype, count, site, reduce, root, declared)
        ctx = self._shm_contexts.get(key)
        if ctx is None:
            if len(self._shm_contexts) >= MAX_CACHED_CONTEXTS:
                self._shm_contexts.clear()
            ctx = self._shm_contexts[key] = ShmContext(self._shm, self.group_id, self.rank, self.size, self._seq,
                                                       coll, dtype, count, site, reduce, root,
                                                       self.cfg.comm.small_bytes, declared)
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
            # seen here: to every peer; heard: over this rank's connections only (issue 32.5)
            self._coll.tell_peers(ctx.seq, lost=exc.rank, connected_only=exc.reported_by is not None)
            if self._members is not None:  # the peers are told group ranks; the user reads global ones
                exc = exc.in_group(self._members, self.group_id)
        elif isinstance(exc, CollectiveMismatch) and exc.reported_by is None and ctx.refused is not None:
            # what this rank ran at the refused message's seq, and what arrived
            try:
                report = encode_report(*ctx.refused)
            except ValueError:  # what arrived is no header at all (a scribbled control page):
                report = b""    # the peers learn that this rank gave up, without the report
            self._coll.tell_peers(ctx.seq, report=report)
        elif isinstance(exc, OpRefused) and exc.reported_by is None:
            # this rank had started the op: pass it on, so the refusing rank (and any other that
            # refused it too) learns the group is unusable rather than waiting on us next time
            self._coll.tell_refused(exc.seq, int(Coll[exc.op.upper()]), exc.rank, exc.reason)
        if self._members is not None and isinstance(exc, (CollectiveMismatch, OpRefused)):
            exc = exc.in_group(self._members, self.group_id)  # as PeerLost: the caller reads global ranks
        self._broken = exc
        return exc

    # -- point to point (zmq_p2p.py) --------------------------------------------------------
    def isend(self, tensor, dst: int, tag: int = 0) -> Work:
        self._check_usable()
        return self._pt.isend(tensor, dst, tag)

    def irecv(self, tensor, src: int | None, tag: int = 0) -> Work:
        """``src`` None: from any peer; the Work's result is the sender's group rank."""
        self._check_usable()
        return self._pt.irecv(tensor, src, tag)

    def close(self, timeout_s: float = 10.0) -> bool:
        """Cancel work in flight (waiters get GroupClosed) and close the sockets once their
        owners have stopped. Returns False if an owner did not stop in time: its sockets are
        then left to the process's exit rather than closed under it (which aborts libzmq)."""
        self._coll.cancel()
        closed = lambda name: GroupClosed(self.group_id, name, None)
        coll_stopped = self._exec.close(closed, timeout_s)
        p2p_stopped = self._p2p.close(timeout_s)
        if self._segment is not None:  # made, never connected
            self._segment.close()
        if coll_stopped:
            if self._shm is not None:
                self._shm.close()
            self._coll.close()
        else:
            log.warning("group %d: an operation did not stop within %gs; leaving its sockets open",
                        self.group_id, timeout_s)
        return coll_stopped and p2p_stopped
