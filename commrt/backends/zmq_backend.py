"""Our backend: the ring collectives over ZeroMQ/TCP, one Endpoint and Executor per group."""
from __future__ import annotations

import collections
import sys
import zlib
from typing import Callable

import torch
import zmq

from .. import dtypes
from ..collectives import ops
from ..collectives.context import Coll, Journal, OpContext
from ..collectives.reduce_ops import ReduceOp, copy_
from ..config import Config
from ..errors import CollectiveMismatch, CommError, PeerLost
from ..transport import Endpoint
from ..transport.memory import keep_freed_memory
from ..wire import P2P, Header
from ..work import Executor, Work
from .base import check_same_dtype, flat_view, split_bounds
from .staging import Staged

STAGE_PIECES = 4  # a staged all_reduce piece is this many pipelining chunks


def _call_site() -> int:
    """24-bit hash of the first caller outside commrt (file and line)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("commrt."):
        frame = frame.f_back
    where = f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else "?"
    return (zlib.crc32(where.encode()) & 0xFFFFFF) or 1


class ZmqBackend:
    name = "zmq"

    def __init__(self, zctx: zmq.Context, cfg: Config, rank: int, size: int, group_id: int,
                 guard=None, members: list[int] | None = None):
        """``members``: the global rank of each group rank (the names their keys carry)."""
        self.rank, self.size, self.group_id, self.cfg = rank, size, group_id, cfg
        c, cl = cfg.comm, cfg.cluster
        if c.keep_freed_memory:
            keep_freed_memory()
        names = [f"rank{g}" for g in (members if members is not None else range(size))]
        make = lambda: Endpoint(zctx, rank, cl.bind_host, cl.advertise_host, c.max_frame_bytes,
                                c.heartbeat_s, c.timeout_s, guard, names)
        self._coll, self._p2p = make(), make()
        self._exec = Executor(f"group{group_id}")
        self._send_exec = Executor(f"group{group_id}-send")
        self._recv_exec = Executor(f"group{group_id}-recv")
        self._seq = 0
        self._journal = Journal()
        self._p2p_seq: collections.Counter = collections.Counter()
        self._broken: BaseException | None = None

    @property
    def addresses(self) -> list[str]:
        return [self._coll.address, self._p2p.address]

    def connect(self, table: list[list[str]]) -> None:
        """``table[r]`` is rank r's ``addresses``."""
        self._coll.connect({r: a[0] for r, a in enumerate(table)})
        self._p2p.connect({r: a[1] for r, a in enumerate(table)})

    # -- running an operation ----------------------------------------------------------------
    def _collective(self, coll: Coll, dtype: torch.dtype, count: int,
                    body: Callable[[OpContext], None], async_op: bool,
                    writeback: Callable[[], None] | None = None, reduce: int = 0,
                    root: int = 0) -> Work | None:
        if self._broken is not None:
            raise CommError(f"group {self.group_id} is unusable after an earlier failure: {self._broken}")
        self._seq += 1
        site = _call_site() if self.cfg.comm.check_call_sites else 0
        ctx = OpContext(self._coll, self.group_id, self.rank, self.size, self._seq, coll, dtype,
                        count, self.cfg.comm.chunk_bytes, self.cfg.comm.small_bytes, site,
                        reduce, root, self._journal)

        def run() -> None:
            try:
                body(ctx)
            except (PeerLost, CollectiveMismatch) as exc:
                # the stream is now out of step with the peers: no later op could be trusted
                self._broken = exc
                if isinstance(exc, PeerLost):
                    self._coll.tell_peers_lost(exc.rank, self.group_id, ctx.seq)
                raise
            if writeback is not None:
                writeback()
        if async_op:
            return self._exec.submit(ctx.name, run)
        self._exec.run(ctx.name, run, self.cfg.comm.timeout_s)
        return None

    # -- collectives ---------------------------------------------------------------------------
    def all_reduce(self, tensor, op=ReduceOp.SUM, async_op=False):
        t = dtypes.as_tensor(tensor)
        if t.is_cuda:  # pieces staged through pinned memory, copies overlapping the network
            staged = Staged(t, STAGE_PIECES * self.cfg.comm.chunk_bytes)
            return self._collective(Coll.ALL_REDUCE, t.dtype, t.numel(),
                                    lambda ctx: staged.run(lambda piece: ops.all_reduce(ctx, piece, op)),
                                    async_op, reduce=op)
        flat, wb = flat_view(tensor)
        return self._collective(Coll.ALL_REDUCE, flat.dtype, flat.numel(),
                                lambda ctx: ops.all_reduce(ctx, flat, op), async_op, wb, reduce=op)

    def reduce_scatter_tensor(self, output, input, op=ReduceOp.SUM, async_op=False):
        out, wb = flat_view(output, "output")
        inp, _ = flat_view(input, "input")
        check_same_dtype(out, inp, "reduce_scatter_tensor")
        if inp.numel() != out.numel() * self.size:
            raise ValueError(f"reduce_scatter_tensor: input has {inp.numel()} elements, expected "
                             f"output ({out.numel()}) x world size ({self.size})")
        return self._collective(Coll.REDUCE_SCATTER, out.dtype, inp.numel(),
                                lambda ctx: ops.reduce_scatter(ctx, out, inp, op), async_op, wb, reduce=op)

    def all_gather_into_tensor(self, output, input, async_op=False):
        out, wb = flat_view(output, "output")
        inp, _ = flat_view(input, "input")
        check_same_dtype(out, inp, "all_gather_into_tensor")
        if out.numel() != inp.numel() * self.size:
            raise ValueError(f"all_gather_into_tensor: output has {out.numel()} elements, expected "
                             f"input ({inp.numel()}) x world size ({self.size})")
        return self._collective(Coll.ALL_GATHER, out.dtype, out.numel(),
                                lambda ctx: ops.all_gather(ctx, out, inp), async_op, wb)

    def broadcast(self, tensor, src, async_op=False):
        flat, wb = flat_view(tensor)
        return self._collective(Coll.BROADCAST, flat.dtype, flat.numel(),
                                lambda ctx: ops.broadcast(ctx, flat, src), async_op, wb, root=src)

    def reduce(self, tensor, dst, op=ReduceOp.SUM, async_op=False):
        flat, wb = flat_view(tensor)
        return self._collective(Coll.REDUCE, flat.dtype, flat.numel(),
                                lambda ctx: ops.reduce(ctx, flat, dst, op), async_op, wb, reduce=op, root=dst)

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None,
                          async_op=False):
        o, i = dtypes.as_tensor(output), dtypes.as_tensor(input)
        out, wb = flat_view(o, "output")
        inp, _ = flat_view(i, "input")
        check_same_dtype(out, inp, "all_to_all_single")
        out_b = split_bounds(out.numel(), o.shape[0] if o.dim() else 1, output_split_sizes, self.size, "output")
        in_b = split_bounds(inp.numel(), i.shape[0] if i.dim() else 1, input_split_sizes, self.size, "input")
        return self._collective(Coll.ALL_TO_ALL, out.dtype, 0,
                                lambda ctx: ops.all_to_all(ctx, out, inp, out_b, in_b), async_op, wb)

    def barrier(self, async_op=False):
        return self._collective(Coll.BARRIER, torch.uint8, 0, ops.barrier, async_op)

    # -- point to point ------------------------------------------------------------------------
    def isend(self, tensor, dst: int, tag: int = 0) -> Work:
        flat, _, seq, code, steps = self._p2p_plan(tensor, "send", dst, tag)

        def run() -> None:
            for step, piece in enumerate(steps):
                payload = piece.view(torch.uint8).numpy() if piece.numel() else b""
                h = Header(P2P, self.group_id, seq, self.rank, tag, code, flat.numel(), step, len(payload))
                self._p2p.send(dst, h, payload, op="send")
            self._p2p.flush("send", seq)
        return self._send_exec.submit("send", run)

    def irecv(self, tensor, src: int, tag: int = 0) -> Work:
        flat, wb, seq, code, steps = self._p2p_plan(tensor, "recv", src, tag)

        def run() -> None:
            for step, piece in enumerate(steps):
                h, payload = self._p2p.recv(src, tag=tag, op="recv", seq=seq)
                if (h.seq, h.dtype, h.count, h.step, h.nbytes) != (seq, code, flat.numel(), step, piece.nbytes):
                    raise CollectiveMismatch(
                        "recv", seq, {"tag": tag, "dtype": dtypes.name_of(code), "count": flat.numel()},
                        {"tag": h.op, "dtype": dtypes.name_of(h.dtype), "count": h.count}, peer=src, rank=self.rank)
                if piece.numel():
                    copy_(piece, torch.frombuffer(payload.buffer, dtype=flat.dtype))
            if wb is not None:
                wb()
        return self._recv_exec.submit("recv", run)

    def _p2p_plan(self, tensor, direction: str, peer: int, tag: int):
        """(flat, write-back, sequence number, dtype code, pieces) of one point-to-point transfer."""
        flat, wb = flat_view(tensor)
        seq = self._next_p2p(direction, peer, tag)
        pe = max(1, self.cfg.comm.chunk_bytes // flat.element_size())
        steps = [flat[a:a + pe] for a in range(0, max(flat.numel(), 1), pe)]
        return flat, wb, seq, dtypes.code_of(flat.dtype), steps

    def _next_p2p(self, direction: str, peer: int, tag: int) -> int:
        if not 0 <= peer < self.size or peer == self.rank:
            raise ValueError(f"{direction}: peer rank {peer} is invalid (rank {self.rank} of {self.size})")
        if tag < 0:
            raise ValueError(f"{direction}: tag must be >= 0, got {tag}")
        key = (direction, peer, tag)
        self._p2p_seq[key] += 1
        return self._p2p_seq[key]

    def close(self) -> None:
        for ex in (self._exec, self._send_exec, self._recv_exec):
            ex.close()
        self._coll.close()
        self._p2p.close()
