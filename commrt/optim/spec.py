"""An optimizer's settings and the parts of its rules that need no array library: which
state it keeps, LAMB's trust ratio. Torch-free, so a process that steps numpy arrays
(``optim/numpy_rules.py``, a parameter-server shard) never loads torch."""
from __future__ import annotations

import math
from dataclasses import dataclass

from commrt.runtime.errors import ConfigError

KINDS = ("sgd", "adamw", "lamb")


@dataclass(frozen=True)
class OptimSpec:
    kind: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"optimizer type {self.kind!r} is invalid; valid: {list(KINDS)}")
        for name, lo, hi in (("lr", 0.0, math.inf), ("momentum", 0.0, math.inf), ("weight_decay", 0.0, math.inf),
                             ("beta1", 0.0, 1.0), ("beta2", 0.0, 1.0), ("eps", 0.0, math.inf)):
            v = getattr(self, name)  # torch.optim's ranges; a string from a config file failed mid-step
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v < hi:
                raise ConfigError(f"optimizer {name} = {v!r} is invalid; valid: a number in [{lo}, {hi})")
        if not isinstance(self.nesterov, bool):
            raise ConfigError(f"optimizer nesterov = {self.nesterov!r} is invalid; valid: true or false")
        if self.nesterov and (self.momentum <= 0 or self.kind != "sgd"):
            raise ConfigError("nesterov needs SGD with momentum > 0")


def state_names(spec: OptimSpec) -> tuple[str, ...]:
    """The per-element state an optimizer keeps (each the shape of its parameter)."""
    if spec.kind == "sgd":
        return ("momentum_buffer",) if spec.momentum else ()
    return ("exp_avg", "exp_avg_sq")


def trust_ratio(w_norm: float, r_norm: float) -> float:
    """phi(||w||) / ||r|| with phi the identity; 1 where either norm is zero (as in the paper's
    reference implementations, so fresh zero-initialised layers still move)."""
    return w_norm / r_norm if w_norm > 0 and r_norm > 0 else 1.0
