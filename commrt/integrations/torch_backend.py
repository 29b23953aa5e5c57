"""gloo and nccl through torch.distributed process groups, behind our Backend interface.

Ranks given to this class are group ranks (like ours); torch wants global ones, so they are
mapped back. AVG runs as SUM with the division our backend uses (after the sum; float16 and
bfloat16 before it: reduce_ops.avg_part), so that AVG (integer AVG floors) agrees across
backends. numpy arrays are viewed as tensors, so results land in place.
A non-contiguous buffer runs as a contiguous copy (written back when the op completes): gloo
reads and writes a tensor's storage as if it were contiguous, so a strided view was reduced
wrongly and the elements between its own were overwritten.
"""
from __future__ import annotations

import datetime
import threading
import time
import weakref

import numpy as np
import torch
import torch.distributed as tdist

# torch 2.13 renamed these (the old names warn); older releases only have the old ones
_ALL_GATHER = getattr(tdist, "all_gather_single", None) or tdist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(tdist, "reduce_scatter_single", None) or tdist.reduce_scatter_tensor

from commrt.collectives import aliasing
from commrt.collectives.reduce_ops import ReduceOp, avg_part, check_defined, finish_avg_
from commrt.runtime.dtypes import as_buffer, as_tensor, negative_strides
from commrt.runtime.errors import CommError, PeerLost
from commrt.runtime.work import Work
from commrt.backends.base import split_bounds, widened

_OPS = {ReduceOp.SUM: tdist.ReduceOp.SUM, ReduceOp.AVG: tdist.ReduceOp.SUM,
        ReduceOp.PRODUCT: tdist.ReduceOp.PRODUCT, ReduceOp.MIN: tdist.ReduceOp.MIN,
        ReduceOp.MAX: tdist.ReduceOp.MAX}


class TorchWork(Work):
    """Wraps a torch Work; runs ``after`` (e.g. AVG's division) once, when it completes.

    ``is_completed()`` asks torch, so polling ends (and AVG is finished) without ``wait()``.
    ``wait(timeout)`` that runs out raises ``CommTimeout`` and leaves the work pending: a later
    wait can still succeed. Only torch's own failure is kept as the work's error.

    When it ended (the comms log, the trace): torch tells a wrapper only when asked, so the
    program's compute between issue and wait counted as the op's time. ``stamps``: torch's
    future of the work (gloo's collectives) completes when the work does, in gloo's thread; its
    callback notes the time. Without one (gloo's send and receive have none; nccl's completes
    when the kernel is queued, not done) the time is when the program waited or polled."""

    def __init__(self, name: str, inner, after=None, polls: bool = True, result=None,
                 peer: int | None = None, lost: set | None = None, stamps: bool = False):
        """``peer``: the global rank a send or receive talks to, named in its failure and then
        added to ``lost``."""
        super().__init__(name)
        self._inner, self._after, self._result_of = inner, after, result
        self._peer, self._lost = peer, lost
        # gloo's point-to-point works report completion only from inside wait() (checked with
        # torch 2.13: is_completed() stays False after the peer has received), so they are
        # waited with torch's own timeout instead of polled
        self._polls = polls
        self._lock = threading.Lock()  # runs ``after`` once, whichever thread sees completion
        if stamps:
            self._stamp_on_completion()

    def _stamp_on_completion(self) -> None:
        try:
            future = self._inner.get_future()
        except (AttributeError, RuntimeError):  # "Work::getFuture not implemented"
            return
        me = weakref.ref(self)  # torch holds the callback: no cycle through C++ that gc cannot see
        future.add_done_callback(lambda _: TorchWork._stamp(me()))

    @staticmethod
    def _stamp(work) -> None:
        if work is not None and work._ended_at is None:
            work._ended_at = time.perf_counter()

    def _complete(self, waited: bool = False) -> None:
        with self._lock:
            if self._done.is_set():
                return
            try:
                if not waited:  # gloo's p2p buffers count completions: wait on them only once
                    self._inner.wait()  # completed: returns at once, or raises torch's error
                if self._after is not None:
                    self._after()
                self._finish(self._result_of() if self._result_of is not None else None, None)
            except Exception as exc:
                self._finish(None, self._named(exc))

    def _named(self, exc: Exception) -> Exception:
        """gloo's failure of a transfer with one peer as the PeerLost our transport raises: its
        RuntimeError names only an address and port (a pipeline stage over gloo whose neighbour
        died read "Connection closed by peer [127.0.0.1]:16308", no rank)."""
        if self._peer is None or not isinstance(exc, RuntimeError) or isinstance(exc, CommError):
            return exc
        if self._lost is not None:
            self._lost.add(self._peer)
        lost = PeerLost(self._peer, self.name, 0, f"torch.distributed: {str(exc).split('. ')[0]}")
        lost.__cause__ = exc
        return lost

    def is_completed(self) -> bool:
        if not self._done.is_set() and self._inner.is_completed():
            self._complete()
        return self._done.is_set()

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None

    def wait(self, timeout: float | None = None) -> bool:
        if timeout is None:
            self._complete()
        elif not self._polls:
            self._wait_inner(timeout)
        else:
            deadline, pause = time.monotonic() + timeout, 50e-6
            while not self.is_completed():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise self._timeout(timeout)
                time.sleep(min(pause, remaining))  # torch offers no wait-with-timeout that
                pause = min(pause * 2, 5e-3)      # leaves the work usable afterwards
        return super().wait(0)

    def _wait_inner(self, timeout: float) -> None:
        try:
            done = self._inner.wait(datetime.timedelta(seconds=max(timeout, 1e-3)))
        except RuntimeError as exc:  # gloo raises on its own timeout; the transfer is abandoned
            if "imeout" not in str(exc):
                self._complete_with(exc)
            done = False
        if done is False:
            raise self._timeout(timeout)
        self._complete(waited=True)

    def _complete_with(self, exc: Exception) -> None:
        """torch's failure as the work's error, raised now and on every later wait."""
        with self._lock:
            if not self._done.is_set():
                self._finish(None, self._named(exc))
        super().wait(0)


def _dense(buf, writes: bool = True) -> tuple[torch.Tensor, object]:
    """(the tensor torch runs on, a write-back for its results or None); ``writes`` false: the
    op only reads it (a read-only array is copied, as_tensor; the write-back is then unused)."""
    if isinstance(buf, np.ndarray) and negative_strides(buf):  # torch cannot view it: a copy
        arr = as_buffer(buf, writes)
        tmp = torch.from_numpy(np.ascontiguousarray(arr))
        return tmp, lambda: np.copyto(arr, tmp.numpy())
    t = as_tensor(buf, writes)
    if t.is_contiguous():
        return t, None
    tmp = t.contiguous()
    return tmp, lambda: t.copy_(tmp)


def _then(*steps):
    """One ``after`` running the given ones (None skipped) in order; None if there are none."""
    steps = [s for s in steps if s is not None]
    return (lambda: [s() for s in steps]) if steps else None


class TorchBackend:
    def __init__(self, name: str, pg, ranks: list[int], rank: int):
        self.name, self.pg, self.ranks, self.rank, self.size = name, pg, ranks, rank, len(ranks)
        self.lost: set[int] = set()  # global ranks a send or receive found gone (shutdown counts them)

    def _finish(self, name: str, work, async_op: bool, after=None):
        if async_op:
            return TorchWork(name, work, after, stamps=self.name == "gloo")
        if after is not None:
            after()
        return None

    def _avg(self, t: torch.Tensor, op: ReduceOp):
        return (lambda: finish_avg_(t, self.size)) if op == ReduceOp.AVG else None

    def all_reduce(self, tensor, op=ReduceOp.SUM, async_op=False):
        t, back = _dense(tensor)
        check_defined(op, t.dtype, "all_reduce")
        t, back = widened(t, op, back)  # integer AVG: summed in 64 bits, not wrapped
        avg_part(t, op, self.size)  # float16 / bfloat16 AVG: divided first, so the sum cannot overflow
        w = tdist.all_reduce(t, _OPS[op], group=self.pg, async_op=async_op)
        return self._finish("all_reduce", w, async_op, _then(self._avg(t, op), back))

    def reduce_scatter_tensor(self, output, input, op=ReduceOp.SUM, async_op=False):
        (out, back), inp = _dense(output), as_tensor(input, writes=False).contiguous()
        check_defined(op, out.dtype, "reduce_scatter_tensor")
        out, back = widened(out, op, back, fresh=True)
        inp, _ = widened(inp, op, None)
        inp = avg_part(inp, op, self.size, copy=True)
        w = _REDUCE_SCATTER(out, inp, _OPS[op], group=self.pg, async_op=async_op)
        return self._finish("reduce_scatter_tensor", w, async_op, _then(self._avg(out, op), back))

    def all_gather_into_tensor(self, output, input, async_op=False):
        (out, back), inp = _dense(output), as_tensor(input, writes=False).contiguous()
        w = _ALL_GATHER(out, inp, group=self.pg, async_op=async_op)
        return self._finish("all_gather_into_tensor", w, async_op, back)

    def broadcast(self, tensor, src, async_op=False):
        t, back = _dense(tensor, writes=self.rank != src)  # the source only reads its buffer
        back = back if self.rank != src else None
        w = tdist.broadcast(t, self.ranks[src], group=self.pg, async_op=async_op)
        return self._finish("broadcast", w, async_op, back)

    def reduce(self, tensor, dst, op=ReduceOp.SUM, async_op=False):
        t, back = _dense(tensor, writes=self.rank == dst)
        check_defined(op, t.dtype, "reduce")
        t, back = widened(t, op, back) if self.rank == dst else (widened(t, op, None)[0], None)
        after = _then(self._avg(t, op), back) if self.rank == dst else None
        if self.rank != dst:  # gloo uses non-root buffers as scratch; ours stay unchanged
            t = t.clone()
        avg_part(t, op, self.size)
        w = tdist.reduce(t, self.ranks[dst], _OPS[op], group=self.pg, async_op=async_op)
        return self._finish("reduce", w, async_op, after)

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None,
                          async_op=False):
        (out, back), inp = _dense(output), as_tensor(input, writes=False)
        for t, s, what in ((out, output_split_sizes, "output"), (inp, input_split_sizes, "input")):
            split_bounds(t.numel(), t.shape[0] if t.dim() else 1, s, self.size, what)
        inp = aliasing.all_to_all_source(out, inp).contiguous()  # gloo alone would return wrong blocks
        w = tdist.all_to_all_single(out, inp, output_split_sizes, input_split_sizes,
                                    group=self.pg, async_op=async_op)
        return self._finish("all_to_all_single", w, async_op, back)

    def barrier(self, async_op=False):
        w = tdist.barrier(group=self.pg, async_op=async_op)
        return self._finish("barrier", w, async_op)

    def isend(self, tensor, dst: int, tag: int = 0) -> Work:
        peer = self.ranks[dst]
        work = tdist.isend(as_tensor(tensor, writes=False).contiguous(), peer, group=self.pg, tag=tag)
        return TorchWork("send", work, polls=False, peer=peer, lost=self.lost)

    def irecv(self, tensor, src: int | None, tag: int = 0) -> Work:
        """``src`` None: from any peer (gloo; nccl refuses); the Work's result is the sender's group rank."""
        t, back = _dense(tensor)
        if src is not None:
            peer = self.ranks[src]
            work = tdist.irecv(t, peer, group=self.pg, tag=tag)
            return TorchWork("recv", work, back, polls=False, peer=peer, lost=self.lost)
        inner = tdist.irecv(t, None, group=self.pg, tag=tag)
        return TorchWork("recv", inner, back, polls=False,
                         result=lambda: self.ranks.index(tdist.get_global_rank(self.pg, inner._source_rank())))

    def close(self) -> None:
        pass
