"""Topology queries, 2-D process groups (a device mesh) and the choice of the hierarchical
collectives, over the runtime's topology (``commrt.topology.nodes``) and ``new_group``.

Like ``torch.distributed.device_mesh``: ``init_device_mesh((nodes, per_node), ("inter", "intra"))``
lays the world out row-major, so ``get_group("intra")`` (the last dimension) holds consecutive
ranks (one node, with the default layout) and ``get_group("inter")`` the ranks with this rank's
local index on every node. No device argument: a rank's device is its own business.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Sequence

import torch

from commrt.runtime import bootstrap
from commrt import distributed
from commrt.collectives import hierarchical
from commrt.collectives.reduce_ops import ReduceOp
from commrt.runtime.errors import ConfigError
from commrt.runtime.group import NON_GROUP_MEMBER, ProcessGroup
from commrt.runtime.work import Executor, Work

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


def _topology():
    return distributed._rt().topology


def get_local_rank() -> int:
    """This rank's index on its node."""
    rt = distributed._rt()
    return rt.topology.local_rank(rt.world.rank)


def get_local_world_size() -> int:
    """Ranks on this rank's node."""
    rt = distributed._rt()
    return rt.topology.local_world_size(rt.world.rank)


def get_node_rank() -> int:
    """This rank's node (GROUP_RANK under torchrun)."""
    rt = distributed._rt()
    return rt.topology.node_rank(rt.world.rank)


def get_num_nodes() -> int:
    return _topology().num_nodes


def get_process_group_ranks(group: ProcessGroup | None = None) -> list[int]:
    """A group's global ranks in group-rank order (``torch.distributed.get_process_group_ranks``)."""
    if group is NON_GROUP_MEMBER:
        raise ValueError("get_process_group_ranks: this process is not a member of that group")
    return list((group or distributed.get_world_group()).ranks)


@dataclasses.dataclass(frozen=True)
class DeviceMesh:
    shape: tuple[int, ...]
    names: tuple[str, ...]
    groups: tuple[ProcessGroup, ...]
    """This rank's group along each dimension."""
    coordinate: tuple[int, ...]
    """This rank's index along each dimension."""

    def get_group(self, name: str | int = 0) -> ProcessGroup:
        return self.groups[self._dim(name)]

    def get_local_rank(self, name: str | int = 0) -> int:
        return self.coordinate[self._dim(name)]

    def size(self, name: str | int | None = None) -> int:
        return math.prod(self.shape) if name is None else self.shape[self._dim(name)]

    def _dim(self, name: str | int) -> int:
        if isinstance(name, int) and 0 <= name < len(self.shape):
            return name
        if name in self.names:
            return self.names.index(name)
        raise KeyError(f"mesh has no dimension {name!r}; dimensions: {list(self.names)}")


def mesh_rows(shape: Sequence[int]) -> list[list[list[int]]]:
    """Pure: for each dimension, the rank lists of its groups (row-major layout)."""
    dims, world = len(shape), math.prod(shape)
    strides = [math.prod(shape[d + 1:]) for d in range(dims)]
    out = []
    for d in range(dims):
        starts = [r for r in range(world) if (r // strides[d]) % shape[d] == 0]
        out.append([[s + i * strides[d] for i in range(shape[d])] for s in starts])
    return out


def init_device_mesh(shape: Sequence[int], names: Sequence[str] | None = None) -> DeviceMesh:
    """Every rank calls this in the same order (it creates groups collectively, like new_group)."""
    shape = tuple(int(s) for s in shape)
    names = tuple(names) if names is not None else tuple(f"dim{d}" for d in range(len(shape)))
    world = distributed.get_world_size()
    if not shape or min(shape) < 1 or math.prod(shape) != world or len(names) != len(shape) \
            or len(set(names)) != len(names):
        raise ConfigError(f"init_device_mesh: shape {shape} with names {names} must multiply to the world "
                          f"size {world}, with one distinct name per dimension")
    return _mesh(distributed._rt(), shape, names)


def _mesh(rt, shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    me = rt.world.rank
    groups = []
    for rows in mesh_rows(shape):
        mine = NON_GROUP_MEMBER
        for ranks in rows:  # every rank creates every group, in the same order
            g = bootstrap.new_group(rt, ranks)
            mine = g if me in ranks else mine
        groups.append(mine)
    coordinate = tuple((me // math.prod(shape[d + 1:])) % shape[d] for d in range(len(shape)))
    return DeviceMesh(shape, names, tuple(groups), coordinate)


# -- the hierarchical collectives' dispatch ------------------------------------------------

@dataclasses.dataclass
class _Levels:
    intra: ProcessGroup
    inter: ProcessGroup
    executor: Executor
    """Runs the composed ops in issue order (async ones on its thread; sync ones inline)."""

    def close(self) -> None:
        self.executor.close()


def _levels(rt) -> _Levels:
    levels = rt.extras.get("hierarchical")
    if levels is None:
        topo = rt.topology
        mesh = _mesh(rt, (topo.num_nodes, topo.per_node()), ("inter", "intra"))
        levels = _Levels(mesh.get_group("intra"), mesh.get_group("inter"), Executor("hierarchical"))
        rt.extras["hierarchical"] = levels
    return levels


def node_groups() -> tuple[ProcessGroup, ProcessGroup]:
    """(this rank's node, this local rank on every node): the world's two-level groups, made
    on first use (collectively: every rank asks in the same world-collective order)."""
    levels = _levels(distributed._rt())
    return levels.intra, levels.inter


def wants_hierarchical(group, nbytes: int) -> bool:
    """Whether ``group``'s collective of ``nbytes`` runs in two levels ([comm] hierarchical).
    Only the world group: its node groups can be made on demand, since every rank calls the
    world's collectives in the same order. "auto": above the size where each rank's part across
    nodes exceeds small_bytes, and only if the probe (``auto_choice``) found the two levels faster."""
    rt = distributed._rt()
    mode, topo = rt.config.comm.hierarchical, rt.topology
    if mode == "never" or (group is not None and group is not rt.world) or topo is None:
        return False
    if topo.num_nodes < 2 or topo.per_node() < 2:
        return False
    if mode == "always":
        return True
    return nbytes // topo.per_node() > rt.config.comm.small_bytes and auto_choice(rt).hierarchical


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
        log.info("rank %d: [comm] hierarchical = auto: a %d B all_reduce took %.2f ms flat, %.2f ms in two "
                 "levels (slowest rank): %s", rt.world.rank, choice.probe_bytes, 1e3 * choice.flat_s,
                 1e3 * choice.hierarchical_s, "two levels" if choice.hierarchical else
                 f"flat (two levels help only when {HIERARCHY_HELPS}x faster)")
    return choice


def _probe(rt) -> AutoChoice:
    levels, world = _levels(rt), rt.world.backend
    buf = torch.zeros(AUTO_PROBE_BYTES // 4)
    segments = segments_for(AUTO_PROBE_BYTES, rt.config.comm.chunk_bytes)
    paths = (lambda: world.all_reduce(buf, ReduceOp.SUM),
             lambda: levels.executor.run("all_reduce", lambda: hierarchical.all_reduce(
                 levels.intra, levels.inter, buf, ReduceOp.SUM, segments), rt.config.comm.timeout_s))
    best = torch.full((2,), math.inf, dtype=torch.float64)
    for r in range(AUTO_PROBE_ROUNDS + 1):  # alternating, the first round a warm-up (pages, connections)
        for i, path in enumerate(paths):
            start = time.perf_counter()
            path()
            if r:
                best[i] = min(float(best[i]), time.perf_counter() - start)
    world.all_reduce(best, ReduceOp.MAX)
    flat_s, hier_s = float(best[0]), float(best[1])
    return AutoChoice(helps(flat_s, hier_s), flat_s, hier_s, AUTO_PROBE_BYTES)


def auto_stats() -> dict | None:
    """``comm_stats()["hierarchical_auto"]``: the auto decision, once made (None before)."""
    choice = distributed._rt().extras.get("hierarchical_auto")
    return None if choice is None else dataclasses.asdict(choice)


def _submit(name: str, fn, async_op: bool) -> Work | None:
    rt = distributed._rt()
    levels = _levels(rt)
    if async_op:
        return levels.executor.submit(name, lambda: fn(levels))
    levels.executor.run(name, lambda: fn(levels), rt.config.comm.timeout_s)
    return None


def segments_for(nbytes: int, chunk_bytes: int) -> int:
    """Pipelined pieces of a hierarchical all_reduce: one per half pipelining chunk, at most
    PIPELINE_SEGMENTS (each piece adds a round of small-message latency to every level). Only
    the first piece's node reduce-scatter and the last one's all-gather leave the cross-node
    link idle, so more pieces leave it idle less: 8 at 16 MiB gained over 2 (issue #14)."""
    return max(1, min(PIPELINE_SEGMENTS, nbytes // max(1, chunk_bytes // 2)))


def all_reduce(tensor, op, async_op: bool = False) -> Work | None:
    flat = tensor.view(-1)  # callers pass contiguous tensors (see distributed)
    segments = segments_for(flat.numel() * flat.element_size(), distributed._rt().config.comm.chunk_bytes)
    return _submit("all_reduce", lambda lv: hierarchical.all_reduce(lv.intra, lv.inter, flat, op, segments),
                   async_op)


def reduce_scatter_tensor(output, input, op, async_op: bool = False) -> Work | None:
    return _submit("reduce_scatter_tensor", lambda lv: hierarchical.reduce_scatter(
        lv.intra, lv.inter, output.view(-1), input.view(-1), op), async_op)


def all_gather_into_tensor(output, input, async_op: bool = False) -> Work | None:
    return _submit("all_gather_into_tensor", lambda lv: hierarchical.all_gather(
        lv.intra, lv.inter, output.view(-1), input.view(-1)), async_op)


def route(group, kind: str, *tensors) -> bool:
    """Whether ``kind`` on ``group`` with these tensors takes the two-level path: the world
    group spanning nodes (see ``wants_hierarchical``) and well-formed contiguous tensors of one
    dtype. Anything else goes the flat way, which also reports malformed arguments."""
    rt = distributed._rt()
    if rt.topology is None or rt.topology.num_nodes < 2 or group is not rt.world:
        return False  # the common case, decided in three attribute reads
    if not all(isinstance(t, torch.Tensor) and t.is_contiguous() for t in tensors) \
            or len({t.dtype for t in tensors}) != 1:
        return False
    world = rt.world.size()
    if kind == "reduce_scatter" and tensors[1].numel() != tensors[0].numel() * world:
        return False
    if kind == "all_gather" and tensors[0].numel() != tensors[1].numel() * world:
        return False
    return wants_hierarchical(group, max(t.numel() for t in tensors) * tensors[0].element_size())


class TwoLevelBackend:
    """``rt``'s world backend with all_reduce, reduce_scatter_tensor and all_gather_into_tensor
    always hierarchical (for ``commrt bench --backend zmq,zmq+hier``: both side by side)."""

    def __init__(self, rt):
        topo = rt.topology
        if topo is None or topo.num_nodes < 2 or topo.per_node() < 2:
            raise ConfigError("a hierarchical backend needs several nodes with the same number (>= 2) of "
                              f"ranks each; this job has node sizes {[len(topo.ranks_on(n)) for n in range(topo.num_nodes)]}")
        self._world, self._levels, self._chunk = rt.world.backend, _levels(rt), rt.config.comm.chunk_bytes
        self.name, self.size, self.rank = f"{self._world.name}+hier", self._world.size, self._world.rank

    def __getattr__(self, name):  # everything else as the flat world backend
        return getattr(self._world, name)

    def all_reduce(self, tensor, op, async_op=False):
        flat = tensor.view(-1)
        hierarchical.all_reduce(self._levels.intra, self._levels.inter, flat, op,
                                segments_for(flat.numel() * flat.element_size(), self._chunk))

    def reduce_scatter_tensor(self, output, input, op, async_op=False):
        hierarchical.reduce_scatter(self._levels.intra, self._levels.inter, output.view(-1), input.view(-1), op)

    def all_gather_into_tensor(self, output, input, async_op=False):
        hierarchical.all_gather(self._levels.intra, self._levels.inter, output.view(-1), input.view(-1))
