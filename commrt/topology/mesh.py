"""Topology queries and 2-D process groups (a device mesh), over the runtime's topology
(``commrt.topology.nodes``) and ``new_group``; the world's two node levels that the two-level
dispatch (``commrt.topology.dispatch``) runs on.

Like ``torch.distributed.device_mesh``: ``init_device_mesh((nodes, per_node), ("inter", "intra"))``
lays the world out row-major, so ``get_group("intra")`` (the last dimension) holds consecutive
ranks (one node, with the default layout) and ``get_group("inter")`` the ranks with this rank's
local index on every node. No device argument: a rank's device is its own business.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from commrt.runtime import bootstrap, world
from commrt.runtime.errors import ConfigError
from commrt.runtime.group import NON_GROUP_MEMBER, ProcessGroup
from commrt.runtime.work import Executor


def _topology():
    return world.current().topology


def get_local_rank() -> int:
    """This rank's index on its node."""
    rt = world.current()
    return rt.topology.local_rank(rt.world.rank)


def get_local_world_size() -> int:
    """Ranks on this rank's node."""
    rt = world.current()
    return rt.topology.local_world_size(rt.world.rank)


def get_node_rank() -> int:
    """This rank's node (GROUP_RANK under torchrun)."""
    rt = world.current()
    return rt.topology.node_rank(rt.world.rank)


def get_num_nodes() -> int:
    return _topology().num_nodes


def get_uniform_local_world_size() -> int:
    """Ranks per node when every node has the same number, else 0: unlike
    ``get_local_world_size``, the same answer on every rank, so collective code can branch on it."""
    return _topology().per_node()


def get_process_group_ranks(group: ProcessGroup | None = None) -> list[int]:
    """A group's global ranks in group-rank order (``torch.distributed.get_process_group_ranks``)."""
    if group is NON_GROUP_MEMBER:
        raise ValueError("get_process_group_ranks: this process is not a member of that group")
    return list((group or world.current().world).ranks)


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
    size = world.current().world.size()
    if not shape or min(shape) < 1 or math.prod(shape) != size or len(names) != len(shape) \
            or len(set(names)) != len(names):
        raise ConfigError(f"init_device_mesh: shape {shape} with names {names} must multiply to the world "
                          f"size {size}, with one distinct name per dimension")
    return _mesh(world.current(), shape, names)


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


# -- the world's two levels ----------------------------------------------------------------

@dataclasses.dataclass
class _Levels:
    intra: ProcessGroup
    inter: ProcessGroup
    executor: Executor
    """Runs the composed ops in issue order (async ones on its thread; sync ones inline)."""

    def close(self) -> None:
        self.executor.close()


def levels_of(rt) -> _Levels:
    levels = rt.extras.get("hierarchical")
    if levels is None:
        topo = rt.topology
        if topo is None or topo.per_node() < 1:  # every rank sees the same layout: all raise alike
            sizes = [len(topo.ranks_on(n)) for n in range(topo.num_nodes)] if topo else "unknown"
            raise ConfigError(f"the world's two node levels need the same number of ranks on every node; "
                              f"this job has node sizes {sizes}")
        mesh = _mesh(rt, (topo.num_nodes, topo.per_node()), ("inter", "intra"))
        levels = _Levels(mesh.get_group("intra"), mesh.get_group("inter"), Executor("hierarchical"))
        rt.extras["hierarchical"] = levels
    return levels


def node_groups() -> tuple[ProcessGroup, ProcessGroup]:
    """(this rank's node, this local rank on every node): the world's two-level groups, made
    on first use (collectively: every rank asks in the same world-collective order)."""
    levels = levels_of(world.current())
    return levels.intra, levels.inter
