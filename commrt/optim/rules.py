"""Optimizer arithmetic as plain functions on tensors, shared by the parameter server (whole
tensors or key ranges) and the ZeRO layers (flat shards).

The update rules follow torch.optim.SGD and torch.optim.AdamW operation by operation, so a
sharded or server-side step equals the single-process one. LAMB follows You et al., "Large
Batch Optimization for Deep Learning" (2019), Algorithm 2: an Adam direction plus decoupled
weight decay, scaled per layer by the trust ratio ||w|| / ||r||. The trust ratio needs norms of
the *whole* parameter tensor, so it is split out: a caller holding only part of a tensor
reduces the partial squared norms first (``lamb_direction_`` then ``lamb_apply_``). The
settings (``OptimSpec``) live in ``optim/spec.py``; the same rules on numpy arrays, for a
process without torch (a parameter-server shard), in ``optim/numpy_rules.py``.
"""
from __future__ import annotations

import math

import torch

from commrt.optim.spec import KINDS, OptimSpec, state_names, trust_ratio

__all__ = ["KINDS", "OptimSpec", "state_names", "trust_ratio", "init_state", "sgd_", "adamw_",
           "lamb_direction_", "lamb_apply_", "step_"]

def init_state(spec: OptimSpec, param: torch.Tensor) -> dict[str, torch.Tensor]:
    return {name: torch.zeros_like(param) for name in state_names(spec)}


def sgd_(p: torch.Tensor, g: torch.Tensor, state: dict, spec: OptimSpec, step: int) -> None:
    """torch.optim.SGD (dampening 0); ``step`` is 1 on the first update."""
    if spec.weight_decay:
        g = g.add(p, alpha=spec.weight_decay)
    if spec.momentum:
        buf = state["momentum_buffer"]
        if step == 1:
            buf.copy_(g)
        else:
            buf.mul_(spec.momentum).add_(g)
        g = g.add(buf, alpha=spec.momentum) if spec.nesterov else buf
    p.add_(g, alpha=-spec.lr)


def _adam_moments_(g: torch.Tensor, state: dict, spec: OptimSpec) -> None:
    state["exp_avg"].lerp_(g, 1 - spec.beta1)
    state["exp_avg_sq"].mul_(spec.beta2).addcmul_(g, g, value=1 - spec.beta2)


def adamw_(p: torch.Tensor, g: torch.Tensor, state: dict, spec: OptimSpec, step: int) -> None:
    """torch.optim.AdamW (amsgrad off), in its order of operations."""
    p.mul_(1 - spec.lr * spec.weight_decay)
    _adam_moments_(g, state, spec)
    bias1 = 1 - spec.beta1 ** step
    bias2_sqrt = math.sqrt(1 - spec.beta2 ** step)
    denom = (state["exp_avg_sq"].sqrt() / bias2_sqrt).add_(spec.eps)
    p.addcdiv_(state["exp_avg"], denom, value=-spec.lr / bias1)


def lamb_direction_(p: torch.Tensor, g: torch.Tensor, state: dict, spec: OptimSpec,
                    step: int) -> torch.Tensor:
    """Update the moments and return r = m_hat / (sqrt(v_hat) + eps) + wd * w."""
    _adam_moments_(g, state, spec)
    m_hat = state["exp_avg"] / (1 - spec.beta1 ** step)
    v_hat = state["exp_avg_sq"] / (1 - spec.beta2 ** step)
    r = m_hat.div_(v_hat.sqrt_().add_(spec.eps))
    if spec.weight_decay:
        r.add_(p, alpha=spec.weight_decay)
    return r


def lamb_apply_(p: torch.Tensor, r: torch.Tensor, trust: float, spec: OptimSpec) -> None:
    p.add_(r, alpha=-spec.lr * trust)


def step_(p: torch.Tensor, g: torch.Tensor, state: dict, spec: OptimSpec, step: int) -> None:
    """One update of a whole parameter tensor (its own norms for LAMB)."""
    if spec.kind == "sgd":
        sgd_(p, g, state, spec, step)
    elif spec.kind == "adamw":
        adamw_(p, g, state, spec, step)
    else:
        r = lamb_direction_(p, g, state, spec, step)
        lamb_apply_(p, r, trust_ratio(p.norm().item(), r.norm().item()), spec)
