"""The public API, mirroring torch.distributed so users already know it.

``src``/``dst`` arguments are global ranks (as in torch); ``group=None`` means the world.
Collectives on a process that is not a member of ``group`` return None, as torch's do.
Buffers are torch tensors or numpy arrays, updated in place; a process that passes only numpy
arrays never imports torch (issue 32.2).
"""
from __future__ import annotations

import dataclasses
import datetime
import operator
import os
from typing import Any

import numpy as np

from commrt import quant as _quantized
from commrt.collectives.reduce_ops import ReduceOp, as_op
from commrt.obs import stats
from commrt.obs.observer import Observer
from commrt.runtime import bootstrap, dtypes, rendezvous, world
from commrt.runtime.arrays import nbytes
from commrt.runtime.config import Config, load_config
from commrt.runtime.errors import CommError
from commrt.runtime.group import NON_GROUP_MEMBER, ProcessGroup
from commrt.runtime.work import Work, on_turn
from commrt.topology import dispatch
from commrt.transport.wire import MAX_TAG

_observer: Observer | None = None  # this runtime's comms log, trace and flight recorder (commrt/obs)
_last_observer: Observer | None = None  # kept after destroy, for comms_summary()


def init_process_group(backend: str | None = None, init_method: str | None = None,
                       rank: int | None = None, world_size: int | None = None,
                       timeout: float | datetime.timedelta | None = None,
                       config: Config | str | os.PathLike | None = None) -> None:
    """Join the job. Arguments override the config file and environment (see README)."""
    if world.get() is not None:
        raise CommError("init_process_group called twice; call destroy_process_group first")
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    comm = {k: v for k, v in (("backend", backend), ("timeout_s", timeout)) if v is not None}
    if isinstance(config, Config):
        cfg = dataclasses.replace(config, comm=dataclasses.replace(config.comm, **comm))
    else:
        cfg = load_config(config, {"comm": comm})
    spec = rendezvous.resolve(
        init_method or cfg.cluster.rendezvous,
        rank if rank is not None else (cfg.cluster.rank if cfg.cluster.rank >= 0 else None),
        world_size or cfg.cluster.world_size or None)
    rt = bootstrap.init_world(cfg, spec)
    world.install(rt)
    _start_observing(rt)


# commrt.comm_stats()["hierarchical_auto"]: what [comm] hierarchical = "auto" measured and chose
# (commrt.quant registers ["quant"] when imported, above)
stats.register("hierarchical_auto", dispatch.auto_stats)

_rt = world.current  # the default runtime (commrt/runtime/world.py)
_group = world.resolve


def is_initialized() -> bool:
    return world.get() is not None


def destroy_process_group(group: ProcessGroup | None = None) -> None:
    rt = _rt()
    if group is None or group is rt.world:
        world.install(None)
        bootstrap.shutdown(rt)
        _stop_observing()
    elif group is not NON_GROUP_MEMBER:
        world.live(rt, group).backend.close()
        rt.groups.remove(group)


def get_rank(group: ProcessGroup | None = None) -> int:
    g = _group(group)
    return -1 if g is None else g.rank


def get_world_size(group: ProcessGroup | None = None) -> int:
    g = _group(group)
    return -1 if g is None else g.size()


def get_backend(group: ProcessGroup | None = None) -> str:
    """The backend actually in use (``auto`` resolved)."""
    g = _group(group)
    return "" if g is None else g.backend.name


def get_world_group() -> ProcessGroup:
    """The default group (``torch.distributed.group.WORLD``)."""
    return _rt().world


def get_config() -> Config:
    return _rt().config


def new_group(ranks: list[int] | None = None, timeout: Any = None, backend: str | None = None):
    """All processes call this in the same order; non-members get NON_GROUP_MEMBER."""
    rt = _rt()
    if backend not in (None, rt.world.backend.name):
        raise CommError(f"new_group: backend {backend!r} differs from the world's {rt.world.backend.name!r}")
    return bootstrap.new_group(rt, list(range(rt.world.size())) if ranks is None else list(ranks))


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False, quant: str | None = None) -> Work | None:
    """``quant="int8" | "int4"``: the block-quantized all_reduce (commrt/quant, SUM/AVG)."""
    g = _group(group)
    if g is None:
        return None
    rec = _begin(g, "all_reduce", tensor, async_op)
    if quant is not None:
        return _call(rec, _quantized.all_reduce, tensor, op, g, async_op, quant)
    return _call(rec, dispatch.all_reduce, tensor, op if type(op) is ReduceOp else as_op(op), g, async_op)


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False,
                          quant: str | None = None) -> Work | None:
    g = _group(group)
    if g is None:
        return None
    rec = _begin(g, "reduce_scatter_tensor", input, async_op)
    if quant is not None:
        return _call(rec, _quantized.reduce_scatter_tensor, output, input, op, g, async_op, quant)
    return _call(rec, dispatch.reduce_scatter_tensor, output, input, as_op(op), g, async_op)


def all_gather_into_tensor(output, input, group=None, async_op=False, quant: str | None = None) -> Work | None:
    g = _group(group)
    if g is None:
        return None
    rec = _begin(g, "all_gather_into_tensor", output, async_op)
    if quant is not None:
        return _call(rec, _quantized.all_gather_into_tensor, output, input, g, async_op, quant)
    return _call(rec, dispatch.all_gather_into_tensor, output, input, g, async_op)


def broadcast(tensor, src: int, group=None, async_op=False) -> Work | None:
    g = _group(group)
    if g is None:
        return None
    root = _root(g, src, "src", "broadcast", async_op)
    return _call(_begin(g, "broadcast", tensor, async_op), g.backend.broadcast, tensor, root, async_op)


def reduce(tensor, dst: int, op=ReduceOp.SUM, group=None, async_op=False) -> Work | None:
    g = _group(group)
    if g is None:
        return None
    root, rop = _root(g, dst, "dst", "reduce", async_op), as_op(op)
    return _call(_begin(g, "reduce", tensor, async_op), g.backend.reduce, tensor, root, rop, async_op)


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                      group=None, async_op=False) -> Work | None:
    """``output`` may share memory with ``input`` (even be the same tensor): every backend then
    sends from a copy of the input (collectives/aliasing.all_to_all_source, the one place)."""
    g = _group(group)
    if g is None:
        return None
    out, inp = dtypes.as_buffer(output), dtypes.as_buffer(input, writes=False)
    return _call(_begin(g, "all_to_all_single", inp, async_op), g.backend.all_to_all_single,
                 out, inp, output_split_sizes, input_split_sizes, async_op)


def _root(g: ProcessGroup, rank: int, what: str, op: str, async_op: bool) -> int:
    """``rank``'s group rank; one outside the group is refused here, and our backend tells the
    peers (``ZmqBackend.refuse``: they fail at once naming this rank instead of waiting in the op)."""
    try:
        return g.group_rank(rank, what)
    except ValueError as exc:
        refuse = getattr(g.backend, "refuse", None)
        raise exc if refuse is None else refuse(op, exc, async_op)


def barrier(group=None, async_op=False) -> Work | None:
    g = _group(group)
    return None if g is None else _call(_begin(g, "barrier", None, async_op), g.backend.barrier, async_op)


def _tag(tag, what: str) -> int:
    """A valid point-to-point tag, checked before anything is sent: a tag the wire cannot carry
    used to leave as a message every receiver drops, and the sender was later blamed (13.6)."""
    try:
        value = operator.index(tag)
    except TypeError:
        raise TypeError(f"{what}: tag must be an integer, got {type(tag).__name__}") from None
    if not 0 <= value < MAX_TAG:
        raise ValueError(f"{what}: tag {tag} is out of range; valid tags are 0 <= tag < 2**62")
    return value


def isend(tensor, dst: int, group=None, tag: int = 0) -> Work | None:
    if type(tag) is not int or not 0 <= tag < MAX_TAG:  # a plain valid int passes without a call
        tag = _tag(tag, "isend")
    g = _group(group)
    if g is None:
        return None
    peer = g.group_rank(dst, "dst")
    return _call(_begin(g, "send", tensor, True, dst, p2p=True), g.backend.isend, tensor, peer, tag)


def irecv(tensor, src: int | None = None, group=None, tag: int = 0) -> Work | None:
    """``src`` None: from any peer; ``work.result()`` is then the sender's group rank."""
    if type(tag) is not int or not 0 <= tag < MAX_TAG:
        tag = _tag(tag, "irecv")
    g = _group(group)
    if g is None:
        return None
    peer = None if src is None else g.group_rank(src, "src")
    rec = _begin(g, "recv", tensor, True, -1 if src is None else src, p2p=True)  # -1: from any source
    return _call(rec, g.backend.irecv, tensor, peer, tag)


def send(tensor, dst: int, group=None, tag: int = 0) -> None:
    work = isend(tensor, dst, group, tag)
    if work is not None:
        work.wait()


def recv(tensor, src: int | None = None, group=None, tag: int = 0) -> int:
    """Returns the sender's (global) rank, like torch; ``src`` None takes the first message with
    ``tag`` from any peer."""
    work = irecv(tensor, src, group, tag)
    if work is None:
        return -1
    work.wait()
    return src if src is not None else _group(group).ranks[work.result()]


# -- observability (commrt/obs): every op above passes _begin and _call -------------------------
def _start_observing(rt: bootstrap.Runtime) -> None:
    global _observer, _last_observer
    # the store's incarnation marks this run's flight records (None: torchrun's agent store)
    _observer = _last_observer = Observer(rt.config, rt.world.rank, rt.world.size(),
                                          getattr(rt.store, "incarnation", None))


def _stop_observing() -> None:
    global _observer
    if _observer is not None:
        _observer.close()
    _observer = None


def _begin(g: ProcessGroup, op: str, tensor, async_op: bool, peer: int = -1, p2p: bool = False):
    """The op's flight record (a sync op is started, an async one queued); None when not observed.
    ``p2p`` apart from ``peer``: a receive from any source has none, and numbered as a collective
    it put the receiver's collective seqs one ahead of every other rank's."""
    obs = _observer
    if obs is None:
        return None
    if tensor is None:
        return obs.begin(g, op, 0, None, peer, async_op, p2p)
    if type(tensor) is np.ndarray:  # the common case in two reads (as_buffer passes it as is)
        return obs.begin(g, op, tensor.nbytes, tensor.dtype, peer, async_op, p2p)
    t = dtypes.as_buffer(tensor, writes=False)  # only looked at: the backend checks what it writes
    return obs.begin(g, op, nbytes(t), t.dtype, peer, async_op, p2p)


def _call(rec, fn, *args):
    """Issue an op and tell its record how it went (an async one's end comes from its Work)."""
    if rec is None:
        return fn(*args)
    on_turn.hook = rec.turn  # a sync op on zmq starts when it gets the group's turn
    try:
        work = fn(*args)
    except BaseException as exc:
        rec.end(exc)
        raise
    finally:
        on_turn.hook = None
    if work is None:  # a sync op: ended here (Observer.issued, one call less on every op)
        rec.end(None)
        return None
    return Observer.issued(rec, work)


def comms_summary() -> list[dict]:
    """The comms log's table (``[log] comms = true``), one dict per (op, size bucket, group,
    backend): count, bytes, total_s, mean/p50/p99 in microseconds, algbw and busbw in GB/s
    (nccl-tests' definitions). Empty when the log is off. After destroy_process_group, the
    table of the runtime just destroyed."""
    return _last_observer.summary() if _last_observer is not None else []


def dump_flight_record(reason: str = "requested") -> str | None:
    """Write this rank's flight record to ``[log] flight_dir`` now (as SIGUSR1 does); its path."""
    if _observer is None:
        raise CommError("commrt is not initialized; call commrt.init_process_group() first")
    return _observer.dump(reason)
