"""Error feedback for quantized communication (LoCo, Xie et al. 2024; DeepSpeed's
``zeropp_loco_param {err_beta, reset_T}``).

Each time a value passes through the codec, what it lost is remembered and added to the next
step's value before quantizing::

    c_t = x_t + e_{t-1}                                  # compensate
    e_t = err_beta * e_{t-1} + (1 - err_beta) * (c_t - dequant(quant(c_t)))

Summed over steps the sent values telescope: sum_t dequant_t = sum_t x_t + (e_0 - e_N) / (1 -
err_beta), so the mean of N steps' results approaches the exact mean like 1/N instead of
keeping a constant bias. Every ``reset_T`` calls the memory starts again from zero (as
DeepSpeed does), which bounds how stale it can grow; so does a call on a tensor of another
size. Unlike DeepSpeed, which stores the error itself in int8, ours stays fp32 (exact, 4 bytes
per element of state). The state lives where the values do: a numpy array for host values, a
tensor on the device for device ones.
"""
from __future__ import annotations

import numpy as np
import torch


class ErrorFeedback:
    """Error memory of one tensor's quantized collectives (one instance per tensor)."""

    def __init__(self, err_beta: float = 0.8, reset_T: int = 1024):
        if not 0.0 <= err_beta < 1.0:
            raise ValueError(f"err_beta = {err_beta!r} is invalid; it must be in [0, 1)")
        if reset_T < 0:
            raise ValueError(f"reset_T = {reset_T!r} is invalid; it must be >= 0 (0: never reset)")
        self.err_beta, self.reset_T = float(err_beta), int(reset_T)
        self.calls = 0
        self.numel: int | None = None  # the tensor's size at the last call
        self._err: dict = {}  # stage -> np.ndarray or torch.Tensor
        self._call: tuple | None = None  # (calls, fresh, numel) of the call begun, until it updates

    @classmethod
    def from_loco(cls, loco_param: dict | None) -> "ErrorFeedback":
        """From DeepSpeed's ``zeropp_loco_param`` dict (missing keys: its documented 0.8 / 1024)."""
        p = dict(loco_param or {})
        unknown = sorted(set(p) - {"err_beta", "reset_T"})
        if unknown:
            raise ValueError(f"unknown key(s) {unknown} in zeropp_loco_param; valid: ['err_beta', 'reset_T']")
        return cls(float(p.get("err_beta", 0.8)), int(p.get("reset_T", 1024)))

    def begin(self, numel: int | None = None) -> None:
        """Called once per collective on a tensor of ``numel`` values: counts calls and forgets
        everything after reset_T calls, or when the size changed. A stage's memory is one
        rank's part (a shard), which can keep its length while it moves to other elements
        (an all_reduce of 10 values on 2 ranks: rank 1's shard 5..9; of 11: 6..10). Nothing
        changes before the call's first ``update`` (exchange.commit, once every hop went
        well): a call that raises leaves the memory and the count as they were."""
        resized = numel is not None and self.numel is not None and numel != self.numel
        fresh = resized or bool(self.reset_T and self.calls + 1 > self.reset_T)
        self._call = (1 if fresh else self.calls + 1, fresh, self.numel if numel is None else numel)

    def compensate(self, stage: str, x):
        """x + the remembered error of ``stage`` (a new fp32/fp64 array or tensor; x is left alone);
        none in a call that starts afresh."""
        err = None if self._call is not None and self._call[1] else self._err.get(stage)
        if not _fits(err, x):
            if isinstance(x, torch.Tensor):
                return x.clone()  # fp32 / fp64 already (see torch_codec.values)
            return np.array(x, dtype=np.float64 if x.dtype == np.float64 else np.float32, copy=True)
        return x + err if isinstance(x, torch.Tensor) else np.add(x, err, dtype=err.dtype)

    def update(self, stage: str, compensated, decoded) -> None:
        if self._call is not None:  # the call begun succeeded: count it (every update follows
            self.calls, fresh, self.numel = self._call  # every compensate of a call)
            self._call = None
            if fresh:
                self._err.clear()
        err = self._err.get(stage)
        new = compensated - decoded
        if not _fits(err, new):
            err = torch.zeros_like(new) if isinstance(new, torch.Tensor) else np.zeros_like(new)
        self._err[stage] = self.err_beta * err + (1.0 - self.err_beta) * new

    def error(self, stage: str):
        """The remembered error of ``stage`` (a copy), or None."""
        err = self._err.get(stage)
        return None if err is None else (err.clone() if isinstance(err, torch.Tensor) else err.copy())


def _fits(err, x) -> bool:
    """Whether a remembered error applies to ``x``: same kind, size and device (a tensor that
    moved between devices, or between the numpy and the torch codec, starts afresh)."""
    if err is None or type(err) is not type(x) or len(err) != len(x):
        return False
    return not isinstance(x, torch.Tensor) or err.device == x.device
