"""The optimizer rules of ``optim/rules.py`` on numpy arrays, for a process that must not pay
for torch: a parameter-server shard keeps its values and state in numpy (issue: "a rank that
costs little"). Each line is the torch rule's operation in its order (torch.optim.SGD,
torch.optim.AdamW, LAMB after You et al. 2019, Algorithm 2), so results agree with torch's to
rounding (torch may fuse a multiply-add that numpy rounds twice); the tests compare them.
Updates are in place; the gradient is never written.
"""
from __future__ import annotations

import math

import numpy as np

from commrt.optim.spec import OptimSpec, state_names, trust_ratio


def init_state(spec: OptimSpec, param: np.ndarray) -> dict[str, np.ndarray]:
    return {name: np.zeros_like(param) for name in state_names(spec)}


def sgd_(p: np.ndarray, g: np.ndarray, state: dict, spec: OptimSpec, step: int) -> None:
    """torch.optim.SGD (dampening 0); ``step`` is 1 on the first update."""
    if spec.weight_decay:
        g = g + spec.weight_decay * p
    if spec.momentum:
        buf = state["momentum_buffer"]
        if step == 1:
            buf[...] = g
        else:
            buf *= spec.momentum
            buf += g
        g = g + spec.momentum * buf if spec.nesterov else buf
    p -= spec.lr * g


def _lerp_(a: np.ndarray, b: np.ndarray, weight: float) -> None:
    """torch.lerp_'s two-sided formula (exact at both ends)."""
    if abs(weight) < 0.5:
        a += weight * (b - a)
    else:
        a[...] = b - (b - a) * (1 - weight)


def _adam_moments_(g: np.ndarray, state: dict, spec: OptimSpec) -> None:
    _lerp_(state["exp_avg"], g, 1 - spec.beta1)
    v = state["exp_avg_sq"]
    v *= spec.beta2
    v += (1 - spec.beta2) * g * g


def adamw_(p: np.ndarray, g: np.ndarray, state: dict, spec: OptimSpec, step: int) -> None:
    """torch.optim.AdamW (amsgrad off), in its order of operations."""
    p *= 1 - spec.lr * spec.weight_decay
    _adam_moments_(g, state, spec)
    bias1 = 1 - spec.beta1 ** step
    bias2_sqrt = math.sqrt(1 - spec.beta2 ** step)
    denom = np.sqrt(state["exp_avg_sq"]) / bias2_sqrt
    denom += spec.eps
    p += -spec.lr / bias1 * state["exp_avg"] / denom


def lamb_direction_(p: np.ndarray, g: np.ndarray, state: dict, spec: OptimSpec, step: int) -> np.ndarray:
    """Update the moments and return r = m_hat / (sqrt(v_hat) + eps) + wd * w."""
    _adam_moments_(g, state, spec)
    m_hat = state["exp_avg"] / (1 - spec.beta1 ** step)
    v_hat = state["exp_avg_sq"] / (1 - spec.beta2 ** step)
    np.sqrt(v_hat, out=v_hat)
    v_hat += spec.eps
    m_hat /= v_hat
    if spec.weight_decay:
        m_hat += spec.weight_decay * p
    return m_hat


def lamb_apply_(p: np.ndarray, r: np.ndarray, trust: float, spec: OptimSpec) -> None:
    p -= spec.lr * trust * r


def sum_sq(a: np.ndarray) -> float:
    """The squared Euclidean norm, summed in float64 (a tensor's segments add theirs)."""
    return float(np.square(a, dtype=np.float64).sum())


def step_(p: np.ndarray, g: np.ndarray, state: dict, spec: OptimSpec, step: int) -> None:
    """One update of a whole parameter tensor (its own norms for LAMB)."""
    if spec.kind == "sgd":
        sgd_(p, g, state, spec, step)
    elif spec.kind == "adamw":
        adamw_(p, g, state, spec, step)
    else:
        r = lamb_direction_(p, g, state, spec, step)
        lamb_apply_(p, r, trust_ratio(sum_sq(p) ** 0.5, sum_sq(r) ** 0.5), spec)
