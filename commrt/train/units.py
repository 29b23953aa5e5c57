"""The units of a ZeRO-sharded model: which parameters share one flat buffer, and what one rank
holds of each (values, fp32 master shard, gradient, optimizer state).

A unit is a gradient bucket (stages 0-2) or one module's own parameters (stage 3); its layout
(``layout.Unit``) says where each parameter sits in the flat buffer and which shard is whose.
"""
from __future__ import annotations

import torch
from torch import nn

from commrt.runtime.errors import ConfigError
from commrt.train.layout import Unit, buckets


class UnitState:
    """One unit's tensors on this rank."""

    def __init__(self, layout: Unit, params: list[nn.Parameter], own: tuple[int, int]):
        self.layout, self.params, self.own = layout, params, own
        self.shapes = [p.shape for p in params]  # kept: stage 3 empties the parameters between uses
        self.full: torch.Tensor | None = None     # gathered values in the compute dtype
        self.master: torch.Tensor | None = None   # fp32 values of the own range (what the optimizer steps)
        self.grad: torch.Tensor | None = None     # fp32: full (stages 0-1) or own shard (2-3)
        self.state: dict[str, torch.Tensor] = {}
        self.pending = 0
        self.grad_zero = False  # stages 2-3: ``grad`` is zeros (the step cleared it), so a reduced shard may replace it
        self.reduced = False  # stage 1's reduce-scatter: ``grad``'s own shard holds a reduced gradient not yet stepped
        self.gathering = None  # zero.Followup of an all-gather in flight (finishes in Zero._gathered)
        self.secondary: torch.Tensor | None = None  # hpZ: this rank's part of the in-node copy
        self.fresh = False  # hpZ: the secondary copy holds the values of the last step
        self.feedback = None   # quant.ErrorFeedback of the quantized gradient reduction (LoCo)
        self.landing = None    # zero_defer: Followup of the replica all-reduce in flight
        self.step_due = None   # zero_defer: (step, clip coefficient) of a step not yet taken

    def views(self, flat: torch.Tensor) -> None:
        """Point the parameters into ``flat`` (the unit's full values)."""
        for p, shape, off, n in zip(self.params, self.shapes, self.layout.offsets, self.layout.numels):
            p.data = flat[off:off + n].view(shape)

    def flat_values(self) -> torch.Tensor:
        """The parameters' current values as one fp32 buffer of the unit's padded size."""
        flat = torch.zeros(self.layout.padded, dtype=torch.float32)
        for p, off, n in zip(self.params, self.layout.offsets, self.layout.numels):
            flat[off:off + n].copy_(p.detach().reshape(-1))
        return flat


def make_units(model: nn.Module, params: list[nn.Parameter], stage: int, cap: int,
               world: int, first_cap: int | None = None) -> list[list[int]]:
    """Parameter indices per unit: buckets (stages 0-2, the first at most ``first_cap``
    elements) or one unit per owning module (stage 3)."""
    if stage < 3:
        return [list(u.params) for u in buckets([p.numel() for p in params], cap, world, first_cap)]
    index = {id(p): i for i, p in enumerate(params)}
    units, seen = [], set()
    for mod in model.modules():
        mine = [index[id(p)] for p in mod.parameters(recurse=False) if id(p) in index]
        if set(mine) & seen:
            raise ConfigError(f"stage 3 cannot shard a parameter shared between modules "
                              f"({type(mod).__name__}); untie it or use stage 2")
        seen.update(mine)
        if mine:
            units.append(mine)
    return units
