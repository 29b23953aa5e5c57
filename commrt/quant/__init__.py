"""Quantized collectives: int8 / int4 block codecs and the all-gather, reduce-scatter and
all-reduce built from them, above the public API like ``train/`` (see collectives.py).

The codecs and collectives run on torch and load on first use (PEP 562), so the front door,
which imports this package, costs a numpy-only rank no torch (issue 32.2); the savings
counters (stats.py, torch-free) are registered at once."""
import importlib

from commrt.quant.stats import STATS
from commrt.obs.stats import register as _register

# commrt.comm_stats()["quant"]: {kind: {calls, wire_bytes, exact_bytes, bytes_saved,
# max_abs_error, max_error_bound}}
_register("quant", STATS.snapshot)

_WHERE = {"Codec": "codecs", "codec_for": "codecs", "quantize": "codecs", "dequantize": "codecs",
          "all_gather_into_tensor": "collectives", "all_reduce": "collectives",
          "reduce_scatter_tensor": "collectives", "hierarchical_all_reduce": "collectives",
          "ErrorFeedback": "feedback"}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


__all__ = ["Codec", "codec_for", "quantize", "dequantize", "all_gather_into_tensor", "all_reduce",
           "reduce_scatter_tensor", "hierarchical_all_reduce", "ErrorFeedback", "STATS"]
