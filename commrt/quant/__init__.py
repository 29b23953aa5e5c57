"""Quantized collectives: int8 / int4 block codecs and the all-gather, reduce-scatter and
all-reduce built from them, above the public API like ``train/`` (see collectives.py)."""
from commrt.quant.codecs import Codec, codec_for, dequantize, quantize
from commrt.quant.collectives import (all_gather_into_tensor, all_reduce, hierarchical_all_reduce,
    reduce_scatter_tensor)
from commrt.quant.feedback import ErrorFeedback
from commrt.quant.stats import STATS
from commrt.obs.stats import register as _register

# commrt.comm_stats()["quant"]: {kind: {calls, wire_bytes, exact_bytes, bytes_saved,
# max_abs_error, max_error_bound}}
_register("quant", STATS.snapshot)


__all__ = ["Codec", "codec_for", "quantize", "dequantize", "all_gather_into_tensor", "all_reduce",
           "reduce_scatter_tensor", "hierarchical_all_reduce", "ErrorFeedback", "STATS"]
