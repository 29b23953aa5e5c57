"""What quantization costs and saves, per collective kind: ``commrt.comm_stats()["quant"]``.

Counted by this process for what it sends to other ranks (the per-rank volume of the
exchange; a rank's own part never leaves it). ``exact_bytes`` is what the same collective
sends in the input dtype, so ``bytes_saved = exact_bytes - wire_bytes``. ``max_abs_error`` is
measured: the largest |x - dequant(quant(x))| over the parts this rank encodes and decodes
itself (its own chunk of every exchange). ``max_error_bound`` is the codec's bound (scale/2 for
round-to-nearest, scale for stochastic) over every block this rank encoded, including the ones
only other ranks decode.
"""
from __future__ import annotations

import threading
from dataclasses import asdict, dataclass


@dataclass
class KindStats:
    calls: int = 0
    wire_bytes: int = 0
    exact_bytes: int = 0
    max_abs_error: float = 0.0
    max_error_bound: float = 0.0
    hierarchical_calls: int = 0
    """Calls that ran in two hops on a multi-node world (only the inter-node hop quantized);
    the rest ran flat, every hop quantized."""

    def as_dict(self) -> dict:
        return {**asdict(self), "bytes_saved": self.exact_bytes - self.wire_bytes}


class QuantStats:
    """One per process (the collectives of every group add to it); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kinds: dict[str, KindStats] = {}

    def record(self, kind: str, wire_bytes: int, exact_bytes: int, error: float, bound: float,
               path: str = "flat") -> None:
        with self._lock:
            k = self._kinds.setdefault(kind, KindStats())
            k.calls += 1
            k.hierarchical_calls += path == "hierarchical"
            k.wire_bytes += wire_bytes
            k.exact_bytes += exact_bytes
            k.max_abs_error = max(k.max_abs_error, error)
            k.max_error_bound = max(k.max_error_bound, bound)

    def snapshot(self) -> dict[str, dict]:
        with self._lock:
            return {kind: k.as_dict() for kind, k in self._kinds.items()}

    def reset(self) -> None:
        with self._lock:
            self._kinds.clear()


STATS = QuantStats()
