"""The codec for device tensors: fused Triton kernels (triton_kernels.py) where they apply,
the torch codec (torch_codec.py) everywhere else, with the same bytes and values either way.

The kernels apply to CUDA tensors of fp32 / fp16 / bf16 values with round-to-nearest, when
Triton imports (it ships with PyTorch's CUDA wheels, not with the CPU wheel, so it is imported
on first use and its absence is a reason, not an error). Elsewhere the torch codec runs:
stochastic rounding draws from a ``torch.Generator`` (the kernels would draw differently), fp64
values compute in fp64, CPU tensors take the torch codec's cache-sized slabs.

The torch codec made each step a pass over memory (issue 34 measured int8 encode at 10% of a
device copy's bytes per second); the kernels read the values once and write the bytes once.
A chunk with a block that cannot be encoded (a non-finite value, an fp16 scale out of range)
comes back from the kernel with a non-finite scale, and the torch codec encodes it again, so
the error message and the marked bytes are the reference's own. So does a chunk whose largest
scale times qmax overflows float32 (a block at float32's largest value: its scale, rounded up,
would decode to inf); the kernel stores that scale as it is, and the check is on the one value
already read back, so it costs nothing.
"""
from __future__ import annotations

import logging
import math

import torch

from commrt.quant import torch_codec
from commrt.quant.codecs import F32_MAX, Codec

log = logging.getLogger(__name__)

FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ENCODE_TILE = 1024
"""Values one encode program handles (whole blocks; a block longer than MAX_COLS is read in tiles).
H200, 1 GiB fp32, block 256: 1024 -> int8 91% / int4 86% of a device copy; 4096 (round 1's
default) -> 39% / 39%: more, smaller programs keep more loads in flight per SM."""
DECODE_TILE = 1024
"""Bytes of codes one decode program handles (H200, 1 GiB: decode+add int8 67% / int4 70% of a
copy at 1024, 54% / 48% at 4096; plain int8 decode 92% against 83%)."""
DECODE4_TILE = 4096
"""Plain int4 decode (no add) is fastest with larger tiles: 113% of a copy at 4096, 75% at 1024."""
NUM_WARPS = 4
MAX_COLS = 2048
"""The widest tile of one block, in values (int8) or pairs of values (int4)."""
SPLIT = True
"""int4: read and write pairs contiguously and split them in registers (False: two strided
accesses, one per element of the pair)."""

FAST = False
"""Encode: a reciprocal a row and the exact division only in tiles with a lane near a
rounding tie (triton_kernels' docstring proves the bytes the same). Off: on the H200 it gained
4-5% for int8 and lost 9% for int4 at the default tile, so the division was not the limit."""

_state: dict = {}


def _kernels():
    """The kernels module, or None (then ``_state['why']`` says why)."""
    if "module" not in _state:
        try:
            from commrt.quant import triton_kernels
            _state.update(module=triton_kernels, why=None)
        except Exception as e:  # ImportError without triton; a broken install raises others
            _state.update(module=None, why=f"triton is not importable ({type(e).__name__}: {e})")
            log.debug("fused codec off: %s", _state["why"])
    return _state["module"]


def set_enabled(on: bool) -> None:
    """Turn the kernels off (the torch codec everywhere) or back on: for comparisons."""
    _state["off"] = not on


def unfit(codec: Codec, t: torch.Tensor) -> str | None:
    """Why the kernels do not run for ``t`` (values to encode, or bytes to decode), or None."""
    if _state.get("off"):
        return "turned off"
    if t.device.type != "cuda":
        return f"a {t.device.type} tensor (the kernels are CUDA's)"
    if t.dtype != torch.uint8 and t.dtype not in FUSED_DTYPES:
        return f"{t.dtype} values (the kernels take {[str(d) for d in FUSED_DTYPES]})"
    if codec.rounding != "nearest":
        return "stochastic rounding (its draws come from torch's generator)"
    return _state["why"] if _kernels() is None else None


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def encode_plan(codec: Codec, tile: int = ENCODE_TILE, max_cols: int = MAX_COLS) -> tuple[int, int, int]:
    """(rows, cols, tiles): blocks per program, tile width in units (values, or pairs for int4)
    and tiles per block. Widths are powers of two >= 2, as Triton's ranges must be."""
    pack = 2 if codec.bits == 4 else 1
    units = codec.block // pack
    cols = min(max(2, _pow2(units)), max_cols)
    return max(1, tile // (cols * pack)), cols, -(-units // cols)


def encode_into(codec: Codec, out: torch.Tensor, x: torch.Tensor, generator: torch.Generator | None = None,
                offset: int = 0, mark: bool = False, tile: int = ENCODE_TILE,
                num_warps: int = NUM_WARPS) -> tuple[float, str | None]:
    """``torch_codec.encode_into``, fused where ``unfit`` says nothing against it."""
    if unfit(codec, x) is not None or unfit(codec, out) is not None:
        return torch_codec.encode_into(codec, out, x, generator, offset, mark)
    n = x.numel()
    if out.numel() != codec.nbytes(n):
        raise ValueError(f"encode_into: out has {out.numel()} bytes, a chunk of {n} needs {codec.nbytes(n)}")
    if n == 0:
        return 0.0, None
    scales = _launch_encode(codec, out, x, tile, num_warps)
    top = float(scales.max())  # the one host sync, as the torch codec's
    if not math.isfinite(top) or top * codec.qmax > F32_MAX:  # scales are >= 0: a block the reference must name
        return torch_codec.encode_into(codec, out, x, generator, offset, mark)
    return top, None


def _launch_encode(codec: Codec, out: torch.Tensor, x: torch.Tensor, tile: int, num_warps: int) -> torch.Tensor:
    """Queue the kernel (no host sync) and return the scales' view of ``out``."""
    n = x.numel()
    flat = x.detach().reshape(-1).contiguous()
    sdt = torch_codec.SCALE_DTYPES[codec.scale_dtype]
    sb = codec.blocks(n) * sdt.itemsize
    cb = codec.code_bytes(n)
    scales, codes = out[:sb].view(sdt), out[sb:sb + cb]
    if out.numel() > sb + cb:
        out[sb + cb:].zero_()
    rows, cols, tiles = encode_plan(codec, tile)
    grid = (-(-codec.blocks(n) // rows),)
    k = _kernels()
    common = dict(BLOCK=codec.block, QMAX=codec.qmax, FP16=codec.scale_dtype == "fp16", ROWS=rows, COLS=cols,
                  NT=tiles, FAST=FAST, num_warps=num_warps)
    if codec.bits == 8:
        k._encode8_kernel[grid](flat, scales, codes.view(torch.int8), n, **common)
    else:
        k._encode4_kernel[grid](flat, scales, codes, n, SPLIT=SPLIT, **common)
    return scales


def decode(codec: Codec, buf: torch.Tensor, numel: int, out: torch.Tensor | None = None,
           dtype: torch.dtype = torch.float32, tile: int | None = None, num_warps: int = NUM_WARPS) -> torch.Tensor:
    """``torch_codec.decode``, fused for fp32 output where ``unfit`` says nothing against it."""
    tile = tile or (DECODE4_TILE if codec.bits == 4 else DECODE_TILE)
    if dtype != torch.float32 or unfit(codec, buf) is not None or (out is not None and not out.is_contiguous()):
        return torch_codec.decode(codec, buf, numel, out, dtype)
    out = torch.empty(numel, dtype=torch.float32, device=buf.device) if out is None else out
    return _decode(codec, buf, numel, out, False, tile, num_warps)


def decode_add(codec: Codec, buf: torch.Tensor, numel: int, acc: torch.Tensor, tile: int = DECODE_TILE,
               num_warps: int = NUM_WARPS) -> torch.Tensor:
    """acc += the chunk's fp32 values, rounded as decode-then-add (the product, then the sum)."""
    if acc.dtype != torch.float32 or not acc.is_contiguous() or unfit(codec, buf) is not None:
        acc += torch_codec.decode(codec, buf, numel, dtype=acc.dtype)
        return acc
    return _decode(codec, buf, numel, acc, True, tile, num_warps)


def _decode(codec: Codec, buf: torch.Tensor, numel: int, dst: torch.Tensor, add: bool, tile: int,
            num_warps: int) -> torch.Tensor:
    if buf.numel() != codec.nbytes(numel):
        raise ValueError(f"decode: chunk has {buf.numel()} bytes, {numel} values need {codec.nbytes(numel)}")
    if numel == 0:
        return dst
    sdt = torch_codec.SCALE_DTYPES[codec.scale_dtype]
    sb = codec.blocks(numel) * sdt.itemsize
    scales, codes = buf[:sb].view(sdt), buf[sb:sb + codec.code_bytes(numel)]
    grid = (-(-codes.numel() // tile),)
    k = _kernels()
    args = dict(BLOCK=codec.block, TILE=tile, ACC=add, num_warps=num_warps)
    if codec.bits == 8:
        k._decode8_kernel[grid](codes.view(torch.int8), scales, dst, dst, numel, **args)
    else:
        k._decode4_kernel[grid](codes, scales, dst, dst, numel, SPLIT=SPLIT, **args)
    return dst
