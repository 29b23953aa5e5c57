"""``torch.distributed.ProcessGroup`` served by one commrt ``ZmqBackend``.

torch calls these methods with group ranks and an options object; each becomes one or more of
commrt's collectives on the group's backend. ``opts.asyncOp`` (set by torch's Python API from
``async_op``) says whether the caller waits at once: synchronous calls run inline in the
caller's thread, as under commrt's own API (no thread hop on the latency path); asynchronous ones
(and every call from C++, e.g. DDP's reducer) run on the group's executor and return a
``TorchWork`` whose future completes when the data is ready.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist

from commrt.integrations.tdist import compose
from commrt.integrations.tdist.compose import copy_out, flat_cat, reduce_op, same_dtype, wire_numel, wire_view
from commrt.integrations.tdist.sparse import all_reduce_sparse
from commrt.integrations.tdist.work import TorchWork

_Launch = Callable[[bool], list]  # async_op -> commrt Works (None for a synchronous call)
MONITOR_TAG = (1 << 62) - 1  # monitored_barrier's own point-to-point tag (above any torch tag)


class CommrtProcessGroup(dist.ProcessGroup):
    """One torch process group over commrt's transport (see docs: "torch.distributed backend")."""

    def __init__(self, backend, rank: int, size: int, members: list[int], release: Callable[[], None],
                 name: str = ""):
        super().__init__(rank, size)
        self._b, self._members, self._release = backend, list(members), release
        self._closed, self._name = False, name

    @property
    def group_name(self) -> str:
        """torch's name of this group (DeviceMesh and the functional collectives look groups up
        by it); the C++ field is not visible through a Python subclass, so it is kept here."""
        return self._name

    def _set_group_name(self, name: str) -> None:
        self._name = name

    def getBackendName(self) -> str:
        return "commrt"

    def __repr__(self) -> str:
        return f"CommrtProcessGroup(rank {self.rank()} of {self.size()}, global ranks {self._members})"

    def _issue(self, name: str, opts, launch: _Launch, result: list,
               after: Callable[[], None] | None = None) -> TorchWork | None:
        """Run ``launch``; a synchronous call returns None once done, which torch's Python API
        accepts ("backends that sync at the C++ level"): no handle is made on the latency path."""
        if opts.asyncOp:
            return TorchWork(name, launch(True), result, after)
        launch(False)
        if after is not None:
            after()
        return None

    def _reduce_flat(self, flat: torch.Tensor, op, dtype: torch.dtype) -> tuple[_Launch, Callable[[], None] | None]:
        """All-reduce of one flat tensor (``dtype`` is the user's, ``flat`` may be its wire view):
        commrt's op, or (bitwise ops) an all-gather and a fold."""
        rop = reduce_op(op, dtype)
        if rop is not None:
            return (lambda a: [self._b.all_reduce(flat, rop, a)]), None
        gathered = torch.empty((self.size(), flat.numel()), dtype=flat.dtype)
        src = compose.to_host(flat).clone()
        return (lambda a: [self._b.all_gather_into_tensor(gathered, src, a)]), \
            (lambda: compose.fold(op, gathered, flat))

    # -- reductions ------------------------------------------------------------------------------
    def allreduce(self, tensors, opts=c10d.AllreduceOptions()):
        (t,) = _one(tensors, "allreduce")
        if t.is_sparse:
            if compose.op_name(opts.reduceOp) != "SUM":
                raise ValueError(f"commrt backend: a sparse all_reduce sums; got {compose.op_name(opts.reduceOp)}")
            all_reduce_sparse(self._b, t, self.size())
            return TorchWork.done("allreduce", [t]) if opts.asyncOp else None
        rop = reduce_op(opts.reduceOp, t.dtype)
        if rop is not None and not opts.asyncOp:  # the latency path, direct
            self._b.all_reduce(wire_view(t), rop, False)
            return None
        launch, after = self._reduce_flat(wire_view(t), opts.reduceOp, t.dtype)
        return self._issue("allreduce", opts, launch, [t], after)

    def allreduce_coalesced(self, tensors, opts=c10d.AllreduceCoalescedOptions()):
        """One flat all-reduce per dtype (in order of first appearance, the same on every rank)."""
        by_dtype: dict = {}
        for t in tensors:  # by the user's dtype: bool and uint8 share a wire type, not their ops
            by_dtype.setdefault(t.dtype, []).append(t)
        parts = []
        for dtype, group in by_dtype.items():
            flat = flat_cat(group)
            parts.append((group, flat, *self._reduce_flat(flat, opts.reduceOp, dtype)))

        def after():
            for group, flat, _, fold in parts:
                if fold is not None:
                    fold()
                copy_out(flat, group)
        return self._issue("allreduce_coalesced", opts,
                           lambda a: [w for _, _, launch, _ in parts for w in launch(a)], list(tensors), after)

    def reduce(self, tensors, opts=c10d.ReduceOptions()):
        (t,) = _one(tensors, "reduce")
        rop = reduce_op(opts.reduceOp, t.dtype)
        if rop is None:  # bitwise: every rank computes it (a reduce's other ranks may hold anything)
            launch, after = self._reduce_flat(wire_view(t), opts.reduceOp, t.dtype)
            return self._issue("reduce", opts, launch, [t], after)
        return self._issue("reduce", opts, lambda a: [self._b.reduce(wire_view(t), opts.rootRank, rop, a)], [t])

    def _reduce_scatter_base(self, output, input, opts=c10d.ReduceScatterOptions()):
        launch, after = self._scatter_part(output, input, opts.reduceOp)
        return self._issue("reduce_scatter", opts, launch, [output], after)

    def _scatter_part(self, out, inp, op) -> tuple[_Launch, Callable[[], None] | None]:
        """One reduce_scatter_tensor: commrt's, or (bitwise ops, which its wire does not carry)
        an all-reduce of the whole input by ``_reduce_flat`` that keeps our block."""
        rop = reduce_op(op, inp.dtype)
        if rop is not None:
            return (lambda a: [self._b.reduce_scatter_tensor(wire_view(out), wire_view(inp), rop, a)]), None
        same_dtype([out, inp], "reduce_scatter_tensor")  # commrt's own op checks these; this path
        if inp.numel() != out.numel() * self.size():     # keeps a block of whatever it is given
            raise ValueError(f"reduce_scatter_tensor: input has {inp.numel()} elements, expected "
                             f"output ({out.numel()}) x world size ({self.size()})")
        return self._scatter_via_all_reduce(out, wire_view(inp).reshape(-1), op)

    def reduce_scatter(self, outputs, input_lists, opts=c10d.ReduceScatterOptions()):
        (out,) = _one(outputs, "reduce_scatter")
        (ins,) = _one(input_lists, "reduce_scatter")
        same_dtype([out, *ins], "reduce_scatter")
        _check_blocks(ins, out, self.rank(), self.size())
        flat = flat_cat(ins)
        rop = reduce_op(opts.reduceOp, out.dtype)
        if rop is not None and all(t.numel() == out.numel() for t in ins):
            return self._issue("reduce_scatter", opts, lambda a: [self._b.reduce_scatter_tensor(
                wire_view(out), flat, rop, a)], [out])
        offsets = [0] + [wire_numel(t) for t in ins]  # uneven blocks: all-reduce, keep our own block
        launch, after = self._scatter_via_all_reduce(out, flat, opts.reduceOp, offsets)
        return self._issue("reduce_scatter", opts, launch, [out], after)

    def _scatter_via_all_reduce(self, out, flat, op, sizes=None) -> tuple[_Launch, Callable[[], None]]:
        flat = compose.to_host(flat).clone()
        n = wire_numel(out)
        sizes = sizes or [0] + [n] * self.size()
        start = sum(sizes[:self.rank() + 1])
        launch, fold = self._reduce_flat(flat, op, out.dtype)
        keep = lambda: (fold and fold(), wire_view(out).copy_(flat[start:start + n].view(wire_view(out).shape)))
        return launch, keep

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=c10d.ReduceScatterOptions()):
        parts = [self._scatter_part(o, i, opts.reduceOp) for o, i in zip(outputs, inputs)]
        return self._issue("reduce_scatter_coalesced", opts, lambda a: [w for launch, _ in parts for w in launch(a)],
                           list(outputs), lambda: [after() for _, after in parts if after is not None])

    # -- data movement ---------------------------------------------------------------------------
    def broadcast(self, tensors, opts=c10d.BroadcastOptions()):
        (t,) = _one(tensors, "broadcast")
        return self._issue("broadcast", opts, lambda a: [self._b.broadcast(wire_view(t), opts.rootRank, a)], [t])

    def _allgather_base(self, output, input, opts=c10d.AllgatherOptions()):
        return self._issue("allgather", opts, lambda a: [self._b.all_gather_into_tensor(
            wire_view(output), wire_view(input), a)], [output])

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=c10d.AllgatherOptions()):
        return self._issue("allgather_coalesced", opts, lambda a: [
            self._b.all_gather_into_tensor(wire_view(o), wire_view(i), a) for o, i in zip(outputs, inputs)],
            list(outputs))

    def allgather(self, output_lists, inputs, opts=c10d.AllgatherOptions()):
        (outs,) = _one(output_lists, "allgather")
        (inp,) = _one(inputs, "allgather")
        _per_rank(outs, "all_gather", "output", self.rank(), self.size())
        return self._gather_lists("allgather", opts, [inp], [[o] for o in outs], outs)

    def allgather_coalesced(self, output_lists, inputs, opts=c10d.AllgatherOptions()):
        return self._gather_lists("allgather_coalesced", opts, list(inputs), output_lists,
                                  [t for row in output_lists for t in row])

    def _gather_lists(self, name, opts, inputs, rows, result):
        """Every rank's ``inputs`` (flattened together) into ``rows[r]`` for each rank r."""
        same_dtype([*inputs, *result], name)
        mine = flat_cat(inputs)
        counts = [sum(wire_numel(t) for t in row) for row in rows]
        flat = torch.empty(sum(counts), dtype=mine.dtype)
        if all(c == mine.numel() for c in counts):
            launch = lambda a: [self._b.all_gather_into_tensor(flat, mine, a)]
        else:  # uneven: an all-to-all that sends our block to everyone
            launch = lambda a: [self._b.all_to_all_single(flat, mine.repeat(self.size()), counts,
                                                          [mine.numel()] * self.size(), a)]
        return self._issue(name, opts, launch, result, lambda: copy_out(flat, result))

    def alltoall_base(self, output, input, output_splits, input_splits, opts=c10d.AllToAllOptions()):
        # an input sharing memory with the output is copied by the backend (aliasing.all_to_all_source)
        return self._issue("alltoall", opts, lambda a: [self._b.all_to_all_single(
            wire_view(output), wire_view(input), list(output_splits) or None, list(input_splits) or None, a)],
            [output])

    def alltoall(self, outputs, inputs, opts=c10d.AllToAllOptions()):
        _per_rank(outputs, "all_to_all", "output", self.rank(), self.size())
        _per_rank(inputs, "all_to_all", "input", self.rank(), self.size())
        same_dtype([*outputs, *inputs], "alltoall")
        mine = flat_cat(inputs)
        flat = torch.empty(sum(t.numel() for t in outputs), dtype=mine.dtype)
        out_s, in_s = [wire_numel(t) for t in outputs], [wire_numel(t) for t in inputs]
        return self._issue("alltoall", opts, lambda a: [self._b.all_to_all_single(flat, mine, out_s, in_s, a)],
                           list(outputs), lambda: copy_out(flat, outputs))

    def gather(self, output_lists, inputs, opts=c10d.GatherOptions()):
        (inp,) = _one(inputs, "gather")
        root, me = opts.rootRank, self.rank()
        outs = output_lists[0] if me == root else []
        if me == root:
            _per_rank(outs, "gather", "output", me, self.size())
        mine = flat_cat([inp])
        send, recv = compose.rooted_splits(self.size(), root, me, [wire_numel(t) for t in outs], mine.numel())
        flat = torch.empty(sum(recv), dtype=mine.dtype)
        return self._issue("gather", opts, lambda a: [self._b.all_to_all_single(flat, mine, recv, send, a)],
                           list(outs), lambda: copy_out(flat, outs))

    def scatter(self, outputs, input_lists, opts=c10d.ScatterOptions()):
        (out,) = _one(outputs, "scatter")
        root, me = opts.rootRank, self.rank()
        ins = input_lists[0] if me == root else []
        if me == root:
            _per_rank(ins, "scatter", "input", me, self.size())
        mine = flat_cat(ins) if ins else torch.empty(0, dtype=wire_view(out).dtype)
        recv, send = compose.rooted_splits(self.size(), root, me, [wire_numel(t) for t in ins], wire_numel(out))
        flat = torch.empty(wire_numel(out), dtype=mine.dtype)
        return self._issue("scatter", opts, lambda a: [self._b.all_to_all_single(flat, mine, recv, send, a)],
                           [out], lambda: copy_out(flat, [out]))

    def barrier(self, opts=c10d.BarrierOptions()):
        return self._issue("barrier", opts, lambda a: [self._b.barrier(a)], [])

    # -- point to point (commrt's progress engine: an isend never waits for its recv) -----------
    def send(self, tensors, dst: int, tag: int):
        (t,) = _one(tensors, "send")
        return TorchWork("send", [self._b.isend(wire_view(t), dst, tag)], [t])

    def recv(self, tensors, src: int, tag: int):
        (t,) = _one(tensors, "recv")
        return TorchWork("recv", [self._b.irecv(wire_view(t), src, tag)], [t])

    def recv_anysource(self, tensors, tag: int):
        (t,) = _one(tensors, "recv")
        return TorchWork("recv", [self._b.irecv(wire_view(t), None, tag)], [t])  # _source_rank(): who sent

    def monitored_barrier(self, timeout=None, wait_all_ranks: bool = False):
        from commrt.integrations.tdist.monitor import monitored_barrier, seconds  # rarely used; kept out of this file's fast paths
        monitored_barrier(self._b, self.rank(), self.size(), self._members, seconds(timeout), wait_all_ranks,
                          MONITOR_TAG)

    # -- lifetime ---------------------------------------------------------------------------------
    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self._b.close()
            finally:
                self._release()

    def abort(self) -> None:
        self.shutdown()


def _one(items, what: str) -> list:
    """torch's per-device lists: one device per process here."""
    if len(items) != 1:
        raise ValueError(f"commrt backend: {what} takes one tensor (list) per process, got {len(items)}")
    return items


def _per_rank(tensors: list, what: str, kind: str, rank: int, size: int) -> None:
    """A list op's per-rank list: without this a wrong length surfaced as the all-to-all or
    all-gather it runs as ("all_to_all_single: output split sizes [2] must be 3 ...")."""
    if len(tensors) != size:
        raise ValueError(f"commrt backend: {what} on rank {rank} needs one {kind} tensor per rank "
                         f"({size}), got {len(tensors)}")


def _check_blocks(ins: list, out: torch.Tensor, rank: int, size: int) -> None:
    """A list reduce_scatter keeps block ``rank``: without this check a wrong-sized output
    silently takes its neighbour's elements (or a short view fails deep in the copy-out)."""
    if len(ins) != size:
        raise ValueError(f"commrt backend: reduce_scatter on rank {rank} needs one input block per rank "
                         f"({size}), got {len(ins)}")
    if out.numel() != ins[rank].numel():
        raise ValueError(f"commrt backend: reduce_scatter on rank {rank}: the output has {out.numel()} "
                         f"elements, expected {ins[rank].numel()} (the size of input block {rank})")


# torch 2.13's Python API calls these names (the C++ side the older ones): one body each
CommrtProcessGroup.all_gather_single = CommrtProcessGroup._allgather_base
CommrtProcessGroup.reduce_scatter_single = CommrtProcessGroup._reduce_scatter_base
CommrtProcessGroup.all_gather_single_coalesced = CommrtProcessGroup.allgather_into_tensor_coalesced
CommrtProcessGroup.reduce_scatter_single_coalesced = CommrtProcessGroup.reduce_scatter_tensor_coalesced
CommrtProcessGroup.all_to_all_single = CommrtProcessGroup.alltoall_base
