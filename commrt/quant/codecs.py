"""Block-wise symmetric int8 / int4 codecs: pure functions over numpy arrays, no processes.

A chunk of ``numel`` values is cut into blocks of ``block`` elements (the last may be short;
nothing is padded that a caller sees). Each block gets one scale ``s = absmax / qmax`` (qmax =
127 for int8, 7 for int4) and its values become ``q = round(x / s)`` in [-qmax, qmax]. The scale
is stored rounded *up* to its dtype (fp32 or fp16), so ``|x| / s <= qmax`` holds exactly and
round-to-nearest never clips: ``|x - q * s| <= s / 2`` per element (plus the rounding of the
arithmetic itself, a few ulp of x). Stochastic rounding (``floor(x / s + u)``, u uniform in
[0, 1)) is unbiased, with ``|x - q * s| < s``.

Encoded chunk layout, ``nbytes(numel)`` bytes: the scales (one per block), then the codes
(int8: one byte each; int4: two per byte, element 2i in the low nibble, stored as q + 8), then
zero padding to a multiple of 4 so that chunks laid end to end keep their scales aligned.

Everything runs through numpy, single-threaded, with no per-block Python loop: torch's
element-wise ops would start an OpenMP pool per rank, and several ranks on one host starve
each other's pools (see collectives/reduce_ops.py). numpy has no bfloat16, so bfloat16 is
converted by bit shifts (exact widening; round-to-nearest-even narrowing).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

BITS = {"int8": 8, "int4": 4}
ROUNDINGS = ("nearest", "stochastic")
SCALE_DTYPES = {"fp32": np.float32, "fp16": np.float16}
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_SLAB = 1 << 17  # elements per encode step: its fp32 temporaries fit in L2


F32_MAX = float(np.finfo(np.float32).max)  # a decoded value (qmax * scale) must stay below it


def scale_range_problem(block: int, absmax: float, scale_dtype: str) -> str:
    """Why a block's scale overflowed, and the way out that exists for this scale dtype."""
    fix = ("use scale_dtype fp32" if scale_dtype != "fp32" else
           "no scale dtype holds it: absmax / qmax (or qmax x its scale, rounded up) is beyond float32's "
           "largest value; rescale the tensor or send it unquantized")
    return f"block {block}: absmax {absmax:.6g} needs a scale beyond {scale_dtype}'s range; {fix}"


@dataclass(frozen=True)
class Codec:
    bits: int = 8
    """8 (int8) or 4 (int4, two codes per byte)."""
    block: int = 256
    """Elements per scale."""
    scale_dtype: str = "fp32"
    """fp32, or fp16 (half the scale bytes; a block whose scale exceeds 65504 is refused)."""
    rounding: str = "nearest"
    """nearest (|error| <= scale / 2) or stochastic (unbiased, |error| < scale)."""

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"bits = {self.bits!r} is invalid; valid: [4, 8]")
        if not isinstance(self.block, int) or self.block < 2 or self.block % 2:
            raise ValueError(f"block = {self.block!r} is invalid; it must be an even integer >= 2")
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"scale_dtype = {self.scale_dtype!r} is invalid; valid: {list(SCALE_DTYPES)}")
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"rounding = {self.rounding!r} is invalid; valid: {list(ROUNDINGS)}")

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1

    @property
    def name(self) -> str:
        return f"int{self.bits}"

    def blocks(self, numel: int) -> int:
        return -(-numel // self.block)

    def code_bytes(self, numel: int) -> int:
        return numel if self.bits == 8 else (numel + 1) // 2

    def nbytes(self, numel: int) -> int:
        """Bytes of one encoded chunk of ``numel`` values, scales included."""
        raw = self.blocks(numel) * np.dtype(SCALE_DTYPES[self.scale_dtype]).itemsize + self.code_bytes(numel)
        return (raw + 3) & ~3

    def encode_into(self, out: np.ndarray, x: np.ndarray, rng: np.random.Generator | None = None,
                    offset: int = 0, mark: bool = False) -> tuple[float, str | None]:
        """Encode the float array ``x`` into the uint8 array ``out`` (``nbytes(x.size)`` long).
        Returns (the largest scale used, None). A block that cannot be encoded (a non-finite
        value, an fp16 scale out of range) raises ValueError naming the first bad element
        (``offset`` + its index) or block; with ``mark=True`` it gets a NaN scale instead and
        the message is returned in place of None: a collective first finishes its exchange,
        so that every rank learns of the problem and none waits for the others in vain."""
        n = x.size
        if out.size != self.nbytes(n):
            raise ValueError(f"encode_into: out has {out.size} bytes, a chunk of {n} needs {self.nbytes(n)}")
        if n == 0:
            return 0.0, None
        x = np.asarray(x).reshape(-1)
        sdt = SCALE_DTYPES[self.scale_dtype]
        sb = self.blocks(n) * np.dtype(sdt).itemsize
        scales = out[:sb].view(sdt)
        codes = out[sb:sb + self.code_bytes(n)]
        out[sb + codes.size:] = 0
        cdt = np.float64 if x.dtype == np.float64 else np.float32
        problem = None
        # slabs of whole blocks, so the temporaries stay in cache (one Python step per slab,
        # not per block); the short last block is a slab of its own
        for a, b in _slabs(n, self.block):
            rows = x[a:b].reshape(-1, min(self.block, b - a))
            s, bad = self._scales(rows, offset + a)
            if bad is not None and not mark:
                raise ValueError(bad)
            problem = problem or bad
            scales[a // self.block:a // self.block + s.size] = s
            v = np.divide(rows, np.where(s == 0, 1, s).astype(cdt)[:, None], dtype=cdt).reshape(-1)
            if bad is not None:
                v[~np.isfinite(v)] = 0.0  # the block's NaN scale is the mark; its codes are 0
            self._round(v, rng)
            self._store_codes(codes, a, v)
        return float(np.nanmax(scales)) if not np.isnan(scales).all() else 0.0, problem

    def marked(self, buf: np.ndarray, numel: int) -> bool:
        """Whether an encoded chunk carries a block marked as unencodable (a NaN scale)."""
        sdt = SCALE_DTYPES[self.scale_dtype]
        return bool(np.isnan(buf[:self.blocks(numel) * np.dtype(sdt).itemsize].view(sdt)).any())

    def _store_codes(self, codes: np.ndarray, start: int, v: np.ndarray) -> None:
        if self.bits == 8:
            np.copyto(codes[start:start + v.size].view(np.int8), v, casting="unsafe")
            return
        u = np.zeros(v.size + (v.size & 1), dtype=np.uint8)  # start is even: whole blocks before it
        np.add(v, 8, out=u[:v.size], casting="unsafe")
        np.left_shift(u[1::2], 4, out=u[1::2])
        np.bitwise_or(u[0::2], u[1::2], out=codes[start // 2:start // 2 + u.size // 2])

    def decode(self, buf: np.ndarray, numel: int, out: np.ndarray | None = None,
               dtype=np.float32) -> np.ndarray:
        """The ``numel`` values of one encoded chunk, as ``dtype`` (fp32 by default; fp64
        gives the exact products ``q * s``)."""
        if buf.size != self.nbytes(numel):
            raise ValueError(f"decode: chunk has {buf.size} bytes, {numel} values need {self.nbytes(numel)}")
        out = np.empty(numel, dtype=dtype) if out is None else out
        if numel == 0:
            return out
        sdt = SCALE_DTYPES[self.scale_dtype]
        sb = self.blocks(numel) * np.dtype(sdt).itemsize
        scales = buf[:sb].view(sdt).astype(out.dtype)
        codes = buf[sb:sb + self.code_bytes(numel)]
        if self.bits == 8:
            q = codes.view(np.int8)
        else:
            q = np.empty(2 * codes.size, dtype=np.int8)
            np.bitwise_and(codes, 0x0F, out=q[0::2], casting="unsafe")
            np.right_shift(codes, 4, out=q[1::2], casting="unsafe")
            q = q[:numel]
            np.subtract(q, 8, out=q)
        for part, d in _split(numel, self.block):
            np.multiply(q[part].reshape(-1, d), scales[_rows(part, self.block)][:, None],
                        out=out[part].reshape(-1, d))
        return out

    def _scales(self, rows: np.ndarray, offset: int) -> tuple[np.ndarray, str | None]:
        """Per-row absmax / qmax, rounded up to the scale dtype; rows that cannot be encoded
        get NaN, with a message naming the first (``offset``: where ``rows`` starts)."""
        absmax = np.abs(rows).max(axis=1).astype(np.float64)
        sdt = SCALE_DTYPES[self.scale_dtype]
        exact = absmax / self.qmax
        with np.errstate(over="ignore", invalid="ignore"):
            s = exact.astype(sdt)
            # round up before the range check: an absmax just above qmax * the dtype's largest
            # value rounds down to it, then up to inf here
            low = s.astype(np.float64) < exact
            s[low] = np.nextafter(s[low], np.inf, dtype=sdt)
            s[s.astype(np.float64) * self.qmax > F32_MAX] = np.inf  # decode's qmax * scale: inf
        problem = None
        if not np.isfinite(absmax).all():
            flat = rows.reshape(-1)
            bad = int(np.flatnonzero(~np.isfinite(flat))[0])
            problem = f"cannot quantize a non-finite value: element {offset + bad} is {flat[bad]}"
        elif np.isinf(s).any():
            row = int(np.flatnonzero(np.isinf(s))[0])
            problem = scale_range_problem(offset // self.block + row, float(absmax[row]), self.scale_dtype)
        s[~np.isfinite(s)] = np.nan
        return s, problem

    def _round(self, v: np.ndarray, rng: np.random.Generator | None) -> None:
        if self.rounding == "nearest":  # |v| <= qmax exactly (scales rounded up): no clipping
            np.rint(v, out=v)
        else:
            rng = rng if rng is not None else _default_rng()
            np.add(v, rng.random(v.size, dtype=v.dtype if v.dtype == np.float32 else np.float64), out=v)
            np.floor(v, out=v)
            np.minimum(v, self.qmax, out=v)  # qmax + u can round up to qmax + 1 in fp32


def _slabs(n: int, block: int) -> list[tuple[int, int]]:
    """[a, b) ranges of whole blocks, about _SLAB elements each, then the short last block."""
    full, step = (n // block) * block, max(1, _SLAB // block) * block
    return [(a, min(full, a + step)) for a in range(0, full, step)] + ([(full, n)] if n > full else [])


def _split(n: int, block: int):
    """(slice, width) of the full blocks and of the short last block, the empty ones skipped."""
    full = (n // block) * block
    return [(s, d) for s, d in ((slice(0, full), block), (slice(full, n), n - full)) if s.stop > s.start]


def _rows(part: slice, block: int) -> slice:
    return slice(part.start // block, -(-part.stop // block))


_RNG: list[np.random.Generator] = []


def _default_rng() -> np.random.Generator:
    if not _RNG:
        _RNG.append(np.random.default_rng())
    return _RNG[0]


def codec_for(quant: str, block: int = 256, scale_dtype: str = "fp32", rounding: str = "nearest") -> Codec:
    """'int8' / 'int4' -> a Codec; anything else is a ValueError listing the valid names."""
    if quant not in BITS:
        raise ValueError(f"quant = {quant!r} is invalid; valid: {list(BITS)}")
    return Codec(BITS[quant], block, scale_dtype, rounding)


def to_numpy_float(t: torch.Tensor) -> np.ndarray:
    """A flat numpy view (fp32 / fp64) or widened copy (fp16, bf16) of a CPU float tensor."""
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"quantized collectives take float tensors; got {t.dtype}; "
                        f"valid: {[str(d) for d in FLOAT_DTYPES]}")
    flat = t.detach().reshape(-1)
    if flat.dtype == torch.bfloat16:  # bf16 is the top half of an fp32: widen by a shift (exact)
        wide = np.left_shift(flat.view(torch.int16).numpy().view(np.uint16).astype(np.uint32), 16)
        return wide.view(np.float32)
    if flat.dtype == torch.float16:
        return flat.numpy().astype(np.float32)
    return flat.numpy()


def store_float(dst: torch.Tensor, values: np.ndarray) -> None:
    """dst[:] = values (fp32 / fp64), rounded to dst's dtype; ``dst`` is a flat CPU tensor."""
    if dst.dtype == torch.bfloat16:  # round to nearest even on the bit pattern
        u = values.astype(np.float32, copy=False).view(np.uint32)
        rounded = (u + (((u >> 16) & 1) + 0x7FFF).astype(np.uint32)) >> 16
        np.copyto(dst.view(torch.int16).numpy().view(np.uint16), rounded, casting="unsafe")
    else:
        np.copyto(dst.numpy(), values, casting="same_kind")


def quantize(x: torch.Tensor, quant: str = "int8", block: int = 256, scale_dtype: str = "fp32",
             rounding: str = "nearest", rng: np.random.Generator | None = None) -> torch.Tensor:
    """One encoded chunk (uint8 tensor) of a float tensor's values."""
    codec = codec_for(quant, block, scale_dtype, rounding)
    values = to_numpy_float(x.cpu())
    out = np.empty(codec.nbytes(values.size), dtype=np.uint8)
    codec.encode_into(out, values, rng)
    return torch.from_numpy(out)


def dequantize(buf: torch.Tensor, numel: int, quant: str = "int8", block: int = 256,
               scale_dtype: str = "fp32", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values of an encoded chunk, as ``dtype`` (the codec computes in fp32 or fp64)."""
    codec = codec_for(quant, block, scale_dtype)
    wide = np.float64 if dtype == torch.float64 else np.float32
    values = codec.decode(buf.numpy(), numel, dtype=wide)
    out = torch.empty(numel, dtype=dtype)
    store_float(out, values)
    return out
