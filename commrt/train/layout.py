"""Where every parameter lives in the flat buffers and which rank owns what: pure functions.

Parameters are grouped into units (a gradient bucket for stages 0-2, one module's parameters for
stage 3). A unit is one flat buffer padded to a multiple of the world size and cut into equal
contiguous shards, shard r owned by rank r, so a reduce-scatter of the unit's gradient lands
each rank's part in its own shard and an all-gather of the shards rebuilds the unit (the same
layout FSDP's flat parameters use).
"""
from __future__ import annotations

from typing import NamedTuple

FIRST_BUCKET_BYTES = 1 << 20  # torch DDP's first bucket: its reduction starts early in backward


class Unit(NamedTuple):
    params: tuple[int, ...]   # indices into the engine's parameter list
    offsets: tuple[int, ...]  # element offset of each parameter in the unit's buffer
    numels: tuple[int, ...]
    numel: int                # without padding
    padded: int               # a multiple of the world size

    def shard(self, rank: int, world: int) -> tuple[int, int]:
        size = self.padded // world
        return rank * size, (rank + 1) * size


def make_unit(params: list[int], numels: list[int], world: int) -> Unit:
    offsets, total = [], 0
    for n in numels:
        offsets.append(total)
        total += n
    padded = -(-max(total, 1) // world) * world
    return Unit(tuple(params), tuple(offsets), tuple(numels), total, padded)


def buckets(numels: list[int], cap: int, world: int, first_cap: int | None = None) -> list[Unit]:
    """Stages 0-2: parameters in reverse registration order (roughly the order backward produces
    their gradients, as torch DDP assumes), packed into units of at most ``cap`` elements (a
    larger parameter gets a unit of its own); the first unit (the first gradients backward
    produces) at most ``first_cap``, so that its reduction starts early in backward (torch DDP's
    1 MiB first bucket)."""
    units, cur, cur_n = [], [], []
    for i in reversed(range(len(numels))):
        limit = cap if units or first_cap is None else min(cap, first_cap)
        if cur and sum(cur_n) + numels[i] > limit:
            units.append(make_unit(cur, cur_n, world))
            cur, cur_n = [], []
        cur.append(i)
        cur_n.append(numels[i])
    if cur:
        units.append(make_unit(cur, cur_n, world))
    return units


def pieces(unit: Unit, lo: int, hi: int) -> list[tuple[int, int, int, int]]:
    """The parts of each parameter inside [lo, hi) of the unit's buffer:
    (position in unit.params, start in the range, stop in the range, start in the parameter)."""
    out = []
    for k, (off, n) in enumerate(zip(unit.offsets, unit.numels)):
        a, b = max(lo, off), min(hi, off + n)
        if a < b:
            out.append((k, a - lo, b - lo, a - off))
    return out
