"""Learning-rate schedules as plain functions of the step, DeepSpeed's ``"scheduler"`` section
(``deepspeed/runtime/lr_schedules.py``: WarmupLR, WarmupDecayLR, WarmupCosineLR).

``step`` is the number of optimizer steps taken so far (DeepSpeed's ``last_batch_iteration``
after its scheduler's first ``step()`` at construction): ``lr_at(schedule, n, base_lr)`` is the
learning rate of the (n+1)-th step, so the first step runs at ``lr_at(s, 0, ...)``, which for the
warmups is ``warmup_min_lr`` (DeepSpeed's value too). A skipped step (non-finite gradients) does
not advance the schedule, as DeepSpeed does not step its scheduler on an overflow.

As DeepSpeed: a warmup lasts ``max(2, warmup_num_steps)`` steps; 'log' warmup rises as
log(step + 1) / log(warmup steps), 'linear' as step / warmup steps. Two choices where DeepSpeed
has none: WarmupCosineLR holds ``cos_min_ratio`` after ``total_num_steps`` (DeepSpeed's cosine
rose again after it), and a ``total_num_steps`` before the end of the warmup is a ConfigError (DeepSpeed
logs a warning, or divides by zero). Torch-free, like ``optim/spec.py``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Mapping

from commrt.runtime.errors import ConfigError

WARMUP_TYPES = ("log", "linear")
# the params each type takes (DeepSpeed's names); total_num_steps is required where listed
PARAMS = {"WarmupLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"),
          "WarmupDecayLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps"),
          "WarmupCosineLR": ("warmup_min_ratio", "cos_min_ratio", "warmup_num_steps", "warmup_type",
                             "total_num_steps")}


@dataclass(frozen=True)
class LRSchedule:
    type: str
    """WarmupLR, WarmupDecayLR or WarmupCosineLR (DeepSpeed's names)."""
    warmup_min_lr: float = 0.0
    """WarmupLR / WarmupDecayLR: the learning rate of the first step."""
    warmup_max_lr: float = 0.001
    """WarmupLR / WarmupDecayLR: the learning rate at the end of the warmup (the optimizer's
    ``lr`` is not used: DeepSpeed's schedule sets it)."""
    warmup_num_steps: int = 1000
    """Steps from the first learning rate to the peak (at least 2 run, as in DeepSpeed)."""
    warmup_type: str = "log"
    """'log' or 'linear' rise during the warmup."""
    total_num_steps: int | None = None
    """WarmupDecayLR: the step at which the learning rate reaches 0 (linear decay after the
    warmup); WarmupCosineLR: the end of the cosine. Required by both."""
    warmup_min_ratio: float = 0.0
    """WarmupCosineLR: the first step's learning rate, as a fraction of the optimizer's ``lr``."""
    cos_min_ratio: float = 0.0001
    """WarmupCosineLR: the final learning rate, as a fraction of the optimizer's ``lr``."""

    def __post_init__(self) -> None:
        if self.type not in PARAMS:
            raise ConfigError(f"scheduler type {self.type!r} is invalid; valid: {list(PARAMS)}")
        if self.warmup_type not in WARMUP_TYPES:
            raise ConfigError(f"scheduler.params.warmup_type = {self.warmup_type!r} is invalid; "
                              f"valid: {list(WARMUP_TYPES)}")
        for name in ("warmup_min_lr", "warmup_max_lr"):
            _check(name, getattr(self, name), 0.0, math.inf)
        for name in ("warmup_min_ratio", "cos_min_ratio"):
            _check(name, getattr(self, name), 0.0, 1.0, closed=True)
        _check_int("warmup_num_steps", self.warmup_num_steps, 0)
        if "total_num_steps" not in PARAMS[self.type]:
            return
        if self.total_num_steps is None:
            raise ConfigError(f"scheduler {self.type} needs params.total_num_steps (an integer > warmup_num_steps)")
        _check_int("total_num_steps", self.total_num_steps, 1)
        if self.total_num_steps <= warmup_steps(self):
            raise ConfigError(f"scheduler.params.total_num_steps = {self.total_num_steps} ends before the warmup "
                              f"does ({warmup_steps(self)} steps); valid: an integer > {warmup_steps(self)}")

    @classmethod
    def from_dict(cls, raw: Any) -> "LRSchedule":
        """DeepSpeed's ``{"type": "WarmupLR", "params": {...}}``; unknown keys are refused."""
        if not isinstance(raw, Mapping):
            raise ConfigError(f"scheduler = {raw!r:.100} is invalid; valid: a table with type and params")
        unknown = sorted(set(raw) - {"type", "params"})
        if unknown:
            raise ConfigError(f"unknown key(s) {unknown} in scheduler; valid: ['params', 'type']")
        kind = raw.get("type")
        if kind not in PARAMS:
            raise ConfigError(f"scheduler type {kind!r} is invalid; valid: {list(PARAMS)} (OneCycle and "
                              "LRRangeTest are not supported: set the rate yourself with engine.set_lr)")
        params = raw.get("params", {})
        if not isinstance(params, Mapping):
            raise ConfigError(f"scheduler.params = {params!r:.100} is invalid; valid: a table of keys")
        unknown = sorted(set(params) - set(PARAMS[kind]))
        if unknown:
            raise ConfigError(f"unknown key(s) {unknown} in scheduler.params of {kind}; valid: {sorted(PARAMS[kind])}")
        return cls(kind, **params)

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _check(name: str, v, lo: float, hi: float, closed: bool = False) -> None:
    ok = not isinstance(v, bool) and isinstance(v, (int, float)) and lo <= v and (v <= hi if closed else v < hi)
    if not ok:
        raise ConfigError(f"scheduler.params.{name} = {v!r} is invalid; valid: a number in "
                          f"[{lo}, {hi}{']' if closed else ')'}")


def _check_int(name: str, v, lo: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ConfigError(f"scheduler.params.{name} = {v!r} is invalid; valid: an integer >= {lo}")


def warmup_steps(s: LRSchedule) -> int:
    return max(2, s.warmup_num_steps)  # DeepSpeed's floor: log(1) would divide by zero


def warmup_fraction(step: int, num_steps: int, kind: str) -> float:
    """How far into a warmup of ``num_steps`` (>= 2) steps ``step`` is: 0 at step 0, below 1."""
    if kind == "log":
        return math.log(step + 1) / math.log(num_steps)
    return step / num_steps


def warmup_lr(s: LRSchedule, step: int) -> float:
    """DeepSpeed's WarmupLR: min + (max - min) * gamma, gamma rising to 1 and holding there."""
    n = warmup_steps(s)
    gamma = warmup_fraction(step, n, s.warmup_type) if step < n else 1.0
    return s.warmup_min_lr + (s.warmup_max_lr - s.warmup_min_lr) * gamma


def warmup_decay_lr(s: LRSchedule, step: int) -> float:
    """DeepSpeed's WarmupDecayLR: WarmupLR's warmup, then gamma = (total - step) / (total - warmup)
    down to 0 at ``total_num_steps`` (and 0 after it)."""
    n = warmup_steps(s)
    if step < n:
        gamma = warmup_fraction(step, n, s.warmup_type)
    else:
        gamma = max(0.0, (s.total_num_steps - step) / max(1, s.total_num_steps - n))
    return s.warmup_min_lr + (s.warmup_max_lr - s.warmup_min_lr) * gamma


def warmup_cosine_ratio(s: LRSchedule, step: int) -> float:
    """DeepSpeed's WarmupCosineLR, as a fraction of the optimizer's lr: warmup_min_ratio rising
    to 1, then a half cosine from 1 down to cos_min_ratio at ``total_num_steps``, held after it."""
    n, step = warmup_steps(s), min(step, s.total_num_steps - 1)  # the last cosine step reaches the floor
    if step < n:
        return s.warmup_min_ratio + (1.0 - s.warmup_min_ratio) * warmup_fraction(step, n, s.warmup_type)
    done = (step - n + 1) / (s.total_num_steps - n)
    return max(0.0, s.cos_min_ratio + (1.0 - s.cos_min_ratio) * (1 + math.cos(math.pi * done)) / 2)


def lr_at(s: LRSchedule, step: int, base_lr: float) -> float:
    """The learning rate of the step after ``step`` taken steps (``base_lr``: the optimizer's)."""
    if s.type == "WarmupLR":
        return warmup_lr(s, step)
    if s.type == "WarmupDecayLR":
        return warmup_decay_lr(s, step)
    return base_lr * warmup_cosine_ratio(s, step)
