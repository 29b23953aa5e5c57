"""``commrt bench --quant int8,int4``: the quantized collectives as one more column beside the
exact ones (backend ``NAME+int8``). Their time is over the unquantized payload, so busbw is
the effective one (what the exact op would need to match); a result counts as wrong when it is
off by more than the codec's bound, and the wire bytes and the largest error are reported."""
from __future__ import annotations

import math

import torch

from commrt.runtime import world
from commrt.runtime.errors import ConfigError
from commrt.collectives.reduce_ops import ReduceOp
from commrt.quant import STATS
from commrt.quant import collectives as qc

MODES = ("int8", "int4")
_PAYLOAD = (torch.float32, torch.float16, torch.bfloat16)


def _as_world(rt):
    """The quantized calls default to the process's runtime: point it at this backend's for
    the call (the bench holds several side by side)."""
    return world.installed(rt)


class QuantBackend:
    """``rt``'s world backend, with all_reduce, reduce_scatter_tensor and all_gather_into_tensor
    quantized (on a multi-node launch they take the two-hop path, see commrt/quant/hierarchical)."""

    def __init__(self, rt, mode: str):
        if mode not in MODES:
            raise ValueError(f"--quant {mode!r} is invalid; valid: {list(MODES)}")
        self._rt, self._world, self.mode = rt, rt.world.backend, mode
        self.name, self.size, self.rank = f"{self._world.name}+{mode}", self._world.size, self._world.rank
        self.wire_bytes = self.exact_bytes = 0
        self.max_abs_error = 0.0

    def __getattr__(self, name):  # barrier, the timing all_reduce, ...: the exact world backend
        return getattr(self._world, name)

    def _run(self, kind: str, fn) -> None:
        before = STATS.snapshot().get(kind, {})
        with _as_world(self._rt):
            fn()
        after = STATS.snapshot()[kind]
        self.wire_bytes += after["wire_bytes"] - before.get("wire_bytes", 0)
        self.exact_bytes += after["exact_bytes"] - before.get("exact_bytes", 0)

    def all_reduce(self, tensor, op, async_op=False):
        if tensor.dtype not in _PAYLOAD or op not in (ReduceOp.SUM, ReduceOp.AVG):
            return self._world.all_reduce(tensor, op, async_op)  # the bench's own timing and checks
        self._run("all_reduce", lambda: qc.all_reduce(tensor, op, quant=self.mode))

    def reduce_scatter_tensor(self, output, input, op, async_op=False):
        self._run("reduce_scatter", lambda: qc.reduce_scatter_tensor(output, input, op, quant=self.mode))

    def all_gather_into_tensor(self, output, input, async_op=False):
        self._run("all_gather", lambda: qc.all_gather_into_tensor(output, input, quant=self.mode))

    def count_wrong(self, got: torch.Tensor, expected: torch.Tensor) -> int:
        """Elements off by more than (n + 1) half-scales of the largest block (the all_reduce
        bound, which covers the others); notes the largest error seen."""
        g, e = got.reshape(-1).double(), expected.reshape(-1).double()
        if g.numel() != e.numel():
            return max(g.numel(), e.numel())
        if not e.numel():
            return 0
        err = (g - e).abs()
        qmax = 127 if self.mode == "int8" else 7
        bound = (self.size + 1) * float(e.abs().max()) / qmax / 2 * 1.01 + 1e-6
        ok = err <= bound  # not err > bound: NaN fails every comparison, and was never wrong
        self.max_abs_error = max(self.max_abs_error, float(err.nan_to_num(nan=math.inf).max()))
        return int((~ok).sum())

    def summary(self) -> str:
        ratio = self.wire_bytes / self.exact_bytes if self.exact_bytes else 0.0
        return (f"quantized: sent {self.wire_bytes} B for {self.exact_bytes} B exact ({ratio:.3f}x), "
                f"largest error {self.max_abs_error:.4g}")


def with_quant(backends: tuple[str, ...], modes: str | None) -> tuple[str, ...]:
    """The backends, plus ``<first>+<mode>`` per requested mode (the first backend quantized)."""
    if not modes:
        return backends
    extra = []
    for mode in (m.strip() for m in modes.split(",") if m.strip()):
        if mode not in MODES:  # ConfigError: one line from the CLI, not a traceback
            raise ConfigError(f"--quant {mode!r} is invalid; valid: {list(MODES)}")
        extra.append(f"{backends[0].split('+')[0]}+{mode}")
    return backends + tuple(extra)
