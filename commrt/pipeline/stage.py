"""Cutting an ``nn.Sequential`` into pipeline stages, and the stage a rank runs."""
from __future__ import annotations

from torch import nn

from commrt import distributed as dist
from commrt.pipeline import balance
from commrt.runtime.errors import ConfigError


def split_points(sizes: list[int], num_stages: int) -> list[int]:
    """Cut indices (len num_stages + 1) giving each stage at least one layer and as even a share
    of ``sizes`` as contiguous cuts allow (each cut at the prefix sum nearest its target)."""
    n, total = len(sizes), sum(sizes)
    cuts, acc, prefix = [0], 0, []
    for s in sizes:
        acc += s
        prefix.append(acc)
    for k in range(1, num_stages):
        lo, hi = cuts[-1] + 1, n - (num_stages - k)  # leave at least one layer for every later stage
        target = total * k / num_stages
        cuts.append(min(range(lo, hi + 1), key=lambda i: (abs(prefix[i - 1] - target), i)))
    return cuts + [n]


def split(model: nn.Sequential, num_stages: int, by: str = "layers", sample=None, loss_fn=None,
          target=None) -> list[nn.Sequential]:
    """``model`` cut into ``num_stages`` contiguous ``nn.Sequential`` stages (sharing its modules):
    ``by="layers"`` evens the number of layers, ``by="params"`` the number of parameters,
    ``by="time"`` the forward + backward time measured on ``sample`` (one micro-batch; the last
    layer with ``loss_fn(output, target)`` when given), agreed over the world (balance.py)."""
    if not isinstance(model, nn.Sequential):
        raise ConfigError(f"split needs an nn.Sequential, got {type(model).__name__}")
    if not 1 <= num_stages <= len(model):
        raise ConfigError(f"cannot split {len(model)} layers into {num_stages} stages")
    if by == "layers":
        sizes = [1] * len(model)
    elif by == "params":
        sizes = [1 + sum(p.numel() for p in m.parameters()) for m in model]  # +1: no empty stage wins
    elif by == "time":
        if sample is None:
            raise ConfigError("split(by='time') needs a sample micro-batch to time the layers on")
        sizes = balance.agreed(balance.layer_times(model, sample, loss_fn, target))
    else:
        raise ConfigError(f"unknown split {by!r}; valid: ['layers', 'params', 'time']")
    cuts = split_points(sizes, num_stages)
    return [model[a:b] for a, b in zip(cuts, cuts[1:])]


class PipelineStage:
    """Stage ``stage_index`` of ``num_stages``, run by this rank of ``group`` (the world by default).
    Stage s lives on group rank ``s % group size``: one stage per rank, or several (interleaved)."""

    def __init__(self, module: nn.Module, stage_index: int, num_stages: int, group=None):
        self.module, self.stage_index, self.num_stages = module, stage_index, num_stages
        self.group = group if group is not None else dist.get_world_group()
        self.group_size = dist.get_world_size(self.group)
        if not 0 <= stage_index < num_stages or num_stages % self.group_size:
            raise ConfigError(f"stage {stage_index} of {num_stages} does not fit a group of {self.group_size} "
                              f"ranks (num_stages must be a multiple of it)")
        if self.group_size == 1 and num_stages > 1:
            raise ConfigError(f"{num_stages} stages on a group of 1 rank would send to itself, which the transports "
                              f"refuse: run the model whole, or on a group of 2 or more ranks")
        if self.rank_of(stage_index) != dist.get_rank():
            raise ConfigError(f"stage {stage_index} belongs on rank {self.rank_of(stage_index)}, "
                              f"not rank {dist.get_rank()}")

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def rank_of(self, stage: int) -> int:
        """Global rank that runs ``stage``."""
        return self.group.ranks[stage % self.group_size]
