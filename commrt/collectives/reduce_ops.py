"""Element-wise reductions on torch tensors, in place, plus ReduceOp."""
from __future__ import annotations

import enum

import torch


class ReduceOp(enum.IntEnum):
    """Same names as ``torch.distributed.ReduceOp``; values are our wire codes."""
    SUM = 0
    AVG = 1
    PRODUCT = 2
    MIN = 3
    MAX = 4


def parse_op(name) -> ReduceOp:
    if isinstance(name, ReduceOp):
        return name
    key = str(name).upper()
    key = {"PROD": "PRODUCT", "MEAN": "AVG"}.get(key, key)
    if key not in ReduceOp.__members__:
        raise ValueError(f"unknown reduce op '{name}'; valid: {list(ReduceOp.__members__)}")
    return ReduceOp[key]


def combine_(acc: torch.Tensor, other: torch.Tensor, op: ReduceOp) -> None:
    """acc = acc (op) other, in place. AVG accumulates as SUM; see finish_avg_."""
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        acc.add_(other)
    elif op == ReduceOp.PRODUCT:
        acc.mul_(other)
    elif op == ReduceOp.MAX:
        torch.maximum(acc, other, out=acc)
    else:
        torch.minimum(acc, other, out=acc)


def combine_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, op: ReduceOp) -> None:
    """out = a (op) b without touching a or b."""
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        torch.add(a, b, out=out)
    elif op == ReduceOp.PRODUCT:
        torch.mul(a, b, out=out)
    elif op == ReduceOp.MAX:
        torch.maximum(a, b, out=out)
    else:
        torch.minimum(a, b, out=out)


def finish_avg_(t: torch.Tensor, world_size: int) -> None:
    """Divide a SUM by the world size. Integer AVG floors, like ``sum // n`` (documented)."""
    if t.is_floating_point():
        t.div_(world_size)
    else:
        t.copy_(torch.div(t, world_size, rounding_mode="floor"))
