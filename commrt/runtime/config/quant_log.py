"""[quant] and [log]: the quantized collectives' encoding, and observability."""
from __future__ import annotations

from dataclasses import dataclass

from commrt.runtime.config.checks import check_choice, check_types, invalid

QUANT_SCALE_DTYPES = ("fp32", "fp16")
QUANT_ROUNDINGS = ("nearest", "stochastic")
QUANT_CPU_CODECS = ("numpy", "torch")


@dataclass(frozen=True)
class QuantConfig:
    block: int = 256
    """Elements per quantization scale in the int8/int4 collectives (``quant=``); an even
    number >= 2. Smaller blocks: smaller error, more scale bytes on the wire."""
    scale_dtype: str = "fp32"
    """fp32 | fp16: the dtype of the per-block scales (fp16 halves their bytes and refuses
    blocks whose scale would exceed 65504)."""
    rounding: str = "nearest"
    """nearest (error <= scale/2 per element) | stochastic (unbiased, error < scale)."""
    pieces: int = 8
    """At most this many pipelined pieces per two-hop (multi-node) quantized all_reduce; 1 runs
    the one-piece path, to measure what the pipeline brings (docs/PERFORMANCE.md). All ranks
    must agree."""
    profile: bool = False
    """Sum per-phase wall-clock spans of the quantized collectives (commrt/quant/profile.py) and
    log them, with the bytes sent across nodes, once at exit. Off: no clock is read."""
    cpu_codec: str = "numpy"
    """numpy | torch: which codec encodes CPU tensors. Both give the same bytes and values, so
    ranks may differ; numpy keeps clear of torch's OpenMP pools, torch exercises the device
    path's code without a GPU. Tensors on a device always use the torch codec."""

    def __post_init__(self) -> None:
        check_types("quant", self)
        if self.block < 2 or self.block % 2:
            raise invalid("quant", "block", self.block, "it must be an even integer >= 2")
        check_choice("quant", "scale_dtype", self.scale_dtype, QUANT_SCALE_DTYPES)
        check_choice("quant", "rounding", self.rounding, QUANT_ROUNDINGS)
        if self.pieces < 1:
            raise invalid("quant", "pieces", self.pieces, "it must be an integer >= 1")
        check_choice("quant", "cpu_codec", self.cpu_codec, QUANT_CPU_CODECS)


@dataclass(frozen=True)
class LogConfig:
    """Observability (commrt/obs): the comms log, the trace and the flight recorder."""
    comms: bool = False
    """Time and count every collective and point-to-point op by op, size bucket (powers of two),
    group and backend; ``commrt.comms_summary()`` returns the table and rank 0 logs it at exit.
    Off: one attribute check per op."""
    verbose: bool = False
    """With ``comms``: also log one JSON line per completed op (logger ``commrt.obs``)."""
    trace_file: str = ""
    """Write a Chrome/Perfetto trace (one track per rank, one thread per group) to this path;
    ``{rank}`` in it is replaced by the rank, else ``.rank<N>`` goes before the extension.
    ``commrt trace-merge OUT FILES...`` joins the ranks' files into one."""
    flight_dir: str = ""
    """Where every rank writes its flight record (``rank<N>.json``) on PeerLost,
    CollectiveMismatch, OpRefused, a CommTimeout, SIGUSR1 or SIGTERM; read with ``commrt flight-record DIR``.
    Empty: the ring buffers are still kept, but a dump goes nowhere (a line says so)."""
    flight_entries: int = 64
    """Ops each group's flight recorder keeps (a ring buffer; always on)."""

    def __post_init__(self) -> None:
        check_types("log", self)
        if not 1 <= self.flight_entries <= 1 << 20:
            raise invalid("log", "flight_entries", self.flight_entries, "it must be between 1 and 1048576")

