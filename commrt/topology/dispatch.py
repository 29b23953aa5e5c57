"""The two-level dispatch: on the world group spanning nodes, all_reduce, reduce_scatter and
all_gather run as compositions over the node groups (``commrt/collectives/hierarchical.py``)
when ``[comm] hierarchical`` says so; every other call goes to ``group.backend`` as it is.
The public API and the quantized collectives both call these, passing the group they hold.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time

import numpy as np

from commrt.backends.base import flat_view, narrow_int, same_kind
from commrt.collectives import hierarchical
from commrt.collectives.reduce_ops import ReduceOp
from commrt.runtime import dtypes, world
from commrt.runtime.arrays import flat_plain, is_contiguous, is_tensor, nbytes, numel
from commrt.runtime.errors import CollectiveMismatch, ConfigError
from commrt.runtime.group import ProcessGroup
from commrt.runtime.work import Work
from commrt.topology.mesh import levels_of

PIPELINE_SEGMENTS = 8
# [comm] hierarchical = "auto" times one all_reduce of this size both ways, once per job, and
# keeps the two levels only when they are this much faster: on a flat network (one switch, or
# ranks that only look like separate nodes) they add steps and node-local copies for nothing.
# Large enough that bandwidth, not latency, decides: at 2 MiB an emulated 100 Mbit link showed
# the two levels only 1.07x faster, where 16-64 MiB show 1.49x.
AUTO_PROBE_BYTES = 8 << 20
AUTO_PROBE_ROUNDS = 2
HIERARCHY_HELPS = 1.1

log = logging.getLogger(__name__)


def wants_hierarchical(group, nbytes: int, op: str = "a collective", quantized: bool = False) -> bool:
    """Whether ``group``'s collective of ``nbytes`` runs in two levels ([comm] hierarchical).
    Only the world group: its node groups can be made on demand, since every rank calls the
    world's collectives in the same order. "auto": above the size where each rank's part across
    nodes exceeds small_bytes, and only if the probe (``auto_choice``) found the two levels faster;
    with ``check_call_sites`` the ranks taking two levels then check that all did (``_same_route``).
    ``quantized`` (quant/hierarchical.py): "auto" takes two levels above that size without the
    probe, which compares exact all_reduces. The flat quantized path sends the codes of every
    rank's chunk for another node across, the two hops only the node sums' (ZeRO++ qgZ's
    hierarchy): half the bytes across at 2 x 2, 1/M in general, where the exact flat
    Rabenseifner is already within the probe's margin of two levels and stays flat."""
    rt = world.current()
    mode, topo = rt.config.comm.hierarchical, rt.topology
    if mode == "never" or (group is not None and group is not rt.world) or topo is None:
        return False
    if topo.num_nodes < 2 or topo.per_node() < 2:
        return False
    if mode == "always":
        return True
    if nbytes // topo.per_node() > rt.config.comm.small_bytes and (quantized or auto_choice(rt).hierarchical):
        if rt.config.comm.check_call_sites:
            _same_route(rt, op, nbytes)
        return True
    return False


def _same_route(rt, op: str, nbytes: int) -> None:
    """Under "auto" each rank routes by its own size: ranks called with sizes on either side of
    the threshold went to the node groups and to the flat world, where no header met another,
    and all waited out the deadline (then blamed a live rank as lost). So the ranks taking two
    levels first pass a world barrier: a rank gone flat meets it in its own world op, and both
    raise CollectiveMismatch at once. Sizes that differ among two-level ranks need nothing more:
    the levels' headers compare them. "always" needs none (every rank takes two levels, whatever
    its size). A debug aid, under ``check_call_sites`` only: the barrier blocks the caller (an
    async op too) and cost a two-level all_reduce 1.5-1.9x on 2 x 2 loopback (256 KiB 1.07 ->
    1.99 ms, 2 MiB 2.49 -> 3.69 ms); without it such ranks wait out the deadline, as NCCL's do."""
    try:
        rt.world.backend.barrier()
    except CollectiveMismatch as exc:
        exc.args = (f"{exc}; this rank's {op} of {nbytes} B takes two levels ([comm] hierarchical = auto) "
                    "and checks first that every rank does (the barrier): ranks whose sizes differ "
                    "took different paths",)
        raise


@dataclasses.dataclass(frozen=True)
class AutoChoice:
    """What "auto" measured (the slowest rank's best time of each path) and chose."""
    hierarchical: bool
    flat_s: float
    hierarchical_s: float
    probe_bytes: int

    def close(self) -> None:  # kept in rt.extras, which closes its entries at teardown
        pass


def helps(flat_s: float, hierarchical_s: float) -> bool:
    return hierarchical_s * HIERARCHY_HELPS <= flat_s


def auto_choice(rt) -> AutoChoice:
    """Decided at the first world collective that could go either way (every rank reaches it
    at the same point, so the probe is collective too) and kept for the rest of the job."""
    choice = rt.extras.get("hierarchical_auto")
    if choice is None:
        choice = rt.extras["hierarchical_auto"] = _probe(rt)
        log.info("[comm] hierarchical = auto: a %d B all_reduce took %.2f ms flat, %.2f ms in two "
                 "levels (slowest rank): %s", choice.probe_bytes, 1e3 * choice.flat_s,
                 1e3 * choice.hierarchical_s, "two levels" if choice.hierarchical else
                 f"flat (two levels help only when {HIERARCHY_HELPS}x faster)")
    return choice


def _probe(rt) -> AutoChoice:
    levels, flat = levels_of(rt), rt.world.backend
    buf = np.zeros(AUTO_PROBE_BYTES // 4, np.float32)
    segments = segments_for(AUTO_PROBE_BYTES, rt.config.comm.chunk_bytes)
    paths = (lambda: flat.all_reduce(buf, ReduceOp.SUM),
             lambda: levels.executor.run("all_reduce", lambda: hierarchical.all_reduce(
                 levels.intra, levels.inter, buf, ReduceOp.SUM, segments), rt.config.comm.timeout_s))
    best = np.full(2, math.inf, np.float64)
    for r in range(AUTO_PROBE_ROUNDS + 1):  # alternating, the first round a warm-up (pages, connections)
        for i, path in enumerate(paths):
            start = time.perf_counter()
            path()
            if r:
                best[i] = min(float(best[i]), time.perf_counter() - start)
    flat.all_reduce(best, ReduceOp.MAX)
    flat_s, hier_s = float(best[0]), float(best[1])
    return AutoChoice(helps(flat_s, hier_s), flat_s, hier_s, AUTO_PROBE_BYTES)


def auto_stats() -> dict | None:
    """``comm_stats()["hierarchical_auto"]``: the auto decision, once made (None before)."""
    choice = world.current().extras.get("hierarchical_auto")
    return None if choice is None else dataclasses.asdict(choice)


def _submit(name: str, fn, async_op: bool, back=None) -> Work | None:
    """Run ``fn(levels)`` on the levels' executor, then ``back`` (a copy's write-back)."""
    rt = world.current()
    levels = levels_of(rt)
    run = (lambda: fn(levels)) if back is None else (lambda: (fn(levels), back()))
    if async_op:
        return levels.executor.submit(name, run)
    levels.executor.run(name, run, rt.config.comm.timeout_s)
    return None


def _plain(x, writes: bool = True):
    """(flat contiguous buffer, write-back or None): a non-contiguous one runs on a copy. Which
    path an op takes must not depend on a rank's memory layout: a rank whose strided view went
    the flat way while its peers went the two levels stalled them all (and skipped joining the
    node groups that levels_of creates on every rank). A read-only array the op ``writes`` is
    refused here, before any level starts (dtypes.as_buffer)."""
    x = dtypes.as_buffer(x, writes)
    if is_contiguous(x):
        return flat_plain(x), None
    return flat_view(x, writes=writes)  # the backends' copy and write-back


def segments_for(nbytes: int, chunk_bytes: int) -> int:
    """Pipelined pieces of a hierarchical all_reduce: one per half pipelining chunk, at most
    PIPELINE_SEGMENTS (each piece adds a round of small-message latency to every level). Only
    the first piece's node reduce-scatter and the last one's all-gather leave the cross-node
    link idle, so more pieces leave it idle less: 8 at 16 MiB gained over 2 (issue #14)."""
    return max(1, min(PIPELINE_SEGMENTS, nbytes // max(1, chunk_bytes // 2)))


def all_reduce(tensor, op: ReduceOp, group: ProcessGroup, async_op: bool = False) -> Work | None:
    """``group.backend.all_reduce``, or the two-level composition on the world spanning nodes."""
    if not route(group, "all_reduce", tensor) or _flat_avg(op, tensor):
        return group.backend.all_reduce(tensor, op, async_op)
    flat, back = _plain(tensor)
    segments = segments_for(nbytes(flat), world.current().config.comm.chunk_bytes)
    return _submit("all_reduce", lambda lv: hierarchical.all_reduce(lv.intra, lv.inter, flat, op, segments),
                   async_op, back)


def reduce_scatter_tensor(output, input, op: ReduceOp, group: ProcessGroup, async_op: bool = False) -> Work | None:
    if not route(group, "reduce_scatter", output, input) or _flat_avg(op, input):
        return group.backend.reduce_scatter_tensor(output, input, op, async_op)
    (out, back), (inp, _) = _plain(output), _plain(input, writes=False)
    out, inp = same_kind(out, inp)
    return _submit("reduce_scatter_tensor", lambda lv: hierarchical.reduce_scatter(lv.intra, lv.inter, out, inp, op),
                   async_op, back)


def all_gather_into_tensor(output, input, group: ProcessGroup, async_op: bool = False) -> Work | None:
    if not route(group, "all_gather", output, input):
        return group.backend.all_gather_into_tensor(output, input, async_op)
    (out, back), (inp, _) = _plain(output), _plain(input, writes=False)
    out, inp = same_kind(out, inp)
    return _submit("all_gather_into_tensor", lambda lv: hierarchical.all_gather(lv.intra, lv.inter, out, inp),
                   async_op, back)


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, *,
                      group: ProcessGroup, async_op: bool = False) -> Work | None:
    """No two-level form: the group's backend, under the same calling convention as the others."""
    return group.backend.all_to_all_single(output, input, output_split_sizes, input_split_sizes, async_op)


def _flat_avg(op: ReduceOp, buf) -> bool:
    """An AVG the flat path runs: integers below 64 bits, which its backend sums in 64 bits
    (backends.base.widened; the two levels' partial sums would wrap), and bool, which its
    backend refuses (reduce_ops.check_defined)."""
    if op != ReduceOp.AVG:
        return False
    buf = dtypes.as_buffer(buf, writes=False)
    return narrow_int(buf) or dtypes.dtype_name(buf.dtype) == "bool"


def route(group, kind: str, *tensors) -> bool:
    """Whether ``kind`` on ``group`` with these tensors takes the two-level path: the world
    group spanning nodes (see ``wants_hierarchical``) and well-formed contiguous tensors of one
    dtype. Anything else goes the flat way, which also reports malformed arguments."""
    rt = world.current()
    if rt.topology is None or rt.topology.num_nodes < 2 or group is not rt.world:
        return False  # the common case, decided in three attribute reads
    # contiguity is each rank's own affair (_plain copies), and so is a numpy array beside a
    # tensor (same_kind): every rank must take the same path, so dtypes compare by name
    if not all(isinstance(t, np.ndarray) or is_tensor(t) for t in tensors) \
            or len({dtypes.dtype_name(t.dtype) for t in tensors}) != 1:
        return False
    n = rt.world.size()
    if kind == "reduce_scatter" and numel(tensors[1]) != numel(tensors[0]) * n:
        return False
    if kind == "all_gather" and numel(tensors[0]) != numel(tensors[1]) * n:
        return False
    return wants_hierarchical(group, max(nbytes(t) for t in tensors), kind)


class TwoLevelBackend:
    """``rt``'s world backend with all_reduce, reduce_scatter_tensor and all_gather_into_tensor
    always hierarchical (for ``commrt bench --backend zmq,zmq+hier``: both side by side)."""

    def __init__(self, rt):
        topo = rt.topology
        if topo is None or topo.num_nodes < 2 or topo.per_node() < 2:
            raise ConfigError("a hierarchical backend needs several nodes with the same number (>= 2) of "
                              f"ranks each; this job has node sizes {[len(topo.ranks_on(n)) for n in range(topo.num_nodes)]}")
        self._world, self._levels, self._chunk = rt.world.backend, levels_of(rt), rt.config.comm.chunk_bytes
        self.name, self.size, self.rank = f"{self._world.name}+hier", self._world.size, self._world.rank

    def __getattr__(self, name):  # everything else as the flat world backend
        return getattr(self._world, name)

    def all_reduce(self, tensor, op, async_op=False):
        flat = flat_plain(tensor)
        hierarchical.all_reduce(self._levels.intra, self._levels.inter, flat, op,
                                segments_for(nbytes(flat), self._chunk))

    def reduce_scatter_tensor(self, output, input, op, async_op=False):
        hierarchical.reduce_scatter(self._levels.intra, self._levels.inter, flat_plain(output), flat_plain(input), op)

    def all_gather_into_tensor(self, output, input, async_op=False):
        hierarchical.all_gather(self._levels.intra, self._levels.inter, flat_plain(output), flat_plain(input))
