"""The block codec of ``codecs.Codec`` written with torch ops: encodes and decodes tensors on
whatever device they are on (a CUDA tensor never leaves its GPU), no processes.

Same encoded chunk layout and the same semantics as ``Codec.encode_into`` / ``Codec.decode``
(see codecs.py): scales = absmax / qmax in fp64 rounded *up* to the scale dtype, codes =
round-half-to-even of x / s (``torch.round`` is ``np.rint``), int4 packed two per byte as q + 8
with element 2i in the low nibble, zero padding to a multiple of 4 bytes. Round-to-nearest
output is byte-identical to the numpy codec's, and decoding gives identical fp32 values,
because every step is one correctly rounded IEEE operation (a division, a product, a
conversion) or exact (abs, max, widening, integer packing), and correctly rounded operations
give the same bits on every device: PyTorch builds its CPU and CUDA kernels without fast-math
(no reciprocal-multiply in place of ``/``, no flushing of subnormals), so ranks that hold CUDA
tensors and ranks that hold CPU tensors produce the same bytes and the same sums. One exception
is torch's own: its CUDA division by a Python or CPU scalar multiplies by the reciprocal, so
every divisor here (and in kernels.Device.divide) is a tensor on the device. The one
conversion that may round twice (fp64 -> fp16 goes through fp32 in torch) is followed by the
round-up to the smallest scale >= absmax / qmax, which is the same value whichever neighbour
the first rounding picked. Stochastic rounding draws from a ``torch.Generator`` on the device
and so differs from the numpy codec's draws (each is unbiased, |error| < s).

On CPU the collectives keep the numpy codec (torch's OpenMP pools, one per rank, starve each
other on a shared host: see codecs.py); this module runs them for device tensors.
"""
from __future__ import annotations

import torch

from commrt.quant.codecs import F32_MAX, Codec, _slabs, scale_range_problem

SCALE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
_BITS = {torch.float32: torch.int32, torch.float16: torch.int16}  # same-width integer views


def values(t: torch.Tensor) -> torch.Tensor:
    """A flat fp32 / fp64 tensor of ``t``'s values on its device (fp16 / bf16 widened: exact)."""
    from commrt.quant.codecs import FLOAT_DTYPES
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"quantized collectives take float tensors; got {t.dtype}; "
                        f"valid: {[str(d) for d in FLOAT_DTYPES]}")
    flat = t.detach().reshape(-1)
    return flat.float() if flat.dtype in (torch.float16, torch.bfloat16) else flat


def encode_into(codec: Codec, out: torch.Tensor, x: torch.Tensor, generator: torch.Generator | None = None,
                offset: int = 0, mark: bool = False) -> tuple[float, str | None]:
    """``Codec.encode_into`` for a tensor ``x`` into the uint8 tensor ``out`` on x's device:
    (the largest scale used, None), or with ``mark=True`` the bad blocks get a NaN scale and
    the message naming the first bad element or block is returned instead of raised."""
    n = x.numel()
    if out.numel() != codec.nbytes(n):
        raise ValueError(f"encode_into: out has {out.numel()} bytes, a chunk of {n} needs {codec.nbytes(n)}")
    if n == 0:
        return 0.0, None
    x = values(x)
    sdt = SCALE_DTYPES[codec.scale_dtype]
    sb = codec.blocks(n) * sdt.itemsize
    scales = out[:sb].view(sdt)
    codes = out[sb:sb + codec.code_bytes(n)]
    out[sb + codes.numel():] = 0
    problem = None
    for a, b in _device_slabs(n, codec.block, x.device):
        rows = x[a:b].reshape(-1, min(codec.block, b - a))
        s, bad = _scales(codec, rows, offset + a)
        if bad is not None and not mark:
            raise ValueError(bad)
        problem = problem or bad
        scales[a // codec.block:a // codec.block + s.numel()] = s
        v = (rows / torch.where(s == 0, 1, s).to(x.dtype)[:, None]).reshape(-1)
        if bad is not None:
            v = torch.where(torch.isfinite(v), v, 0.0)  # the block's NaN scale is the mark; its codes are 0
        _store_codes(codec, codes, a, _round(codec, v, generator))
    return float(torch.nan_to_num(scales, nan=0.0).max()), problem  # scales >= 0; all marked: 0.0


def _device_slabs(n: int, block: int, device: torch.device) -> list[tuple[int, int]]:
    """The numpy codec's cache-sized slabs on CPU; one slab of whole blocks (and the short last
    block) on a GPU, where each slab costs a kernel launch and a host sync for its check."""
    if device.type == "cpu":
        return _slabs(n, block)
    full = (n // block) * block
    return [(a, b) for a, b in ((0, full), (full, n)) if b > a]


def _scales(codec: Codec, rows: torch.Tensor, offset: int) -> tuple[torch.Tensor, str | None]:
    """Per-row absmax / qmax in fp64, rounded up to the scale dtype; rows that cannot be
    encoded get NaN, with a message naming the first (``offset``: where ``rows`` starts)."""
    sdt = SCALE_DTYPES[codec.scale_dtype]
    absmax = rows.abs().amax(dim=1).double()  # amax propagates NaN, as numpy's max does
    exact = absmax / torch.tensor(codec.qmax, dtype=torch.float64, device=rows.device)  # a true division
    s = exact.to(sdt)
    # the smallest scale >= exact: one step up (bit pattern + 1) where the rounding went down;
    # scales are >= 0, so +0 steps to the smallest subnormal and the largest finite to inf
    bits = s.view(_BITS[sdt])
    bits.add_((s.double() < exact).to(bits.dtype))
    ok = torch.isfinite(s) & (s.double() * codec.qmax <= F32_MAX)  # decode's qmax * scale: finite
    if bool(ok.all()):  # one host sync per slab
        return s, None
    if not bool(torch.isfinite(absmax).all()):
        flat = rows.reshape(-1)
        bad = int(torch.nonzero(~torch.isfinite(flat))[0])
        problem = f"cannot quantize a non-finite value: element {offset + bad} is {float(flat[bad])}"
    else:
        row = int(torch.nonzero(~ok)[0])
        problem = scale_range_problem(offset // codec.block + row, float(absmax[row]), codec.scale_dtype)
    return torch.where(ok, s, float("nan")), problem


def _round(codec: Codec, v: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    if codec.rounding == "nearest":  # |v| <= qmax exactly (scales rounded up): no clipping
        return torch.round(v)  # half to even, as np.rint
    u = torch.rand(v.shape, generator=generator, dtype=v.dtype, device=v.device)
    return torch.floor(v + u).clamp_(max=codec.qmax)  # qmax + u can round up to qmax + 1 in fp32


def _store_codes(codec: Codec, codes: torch.Tensor, start: int, v: torch.Tensor) -> None:
    if codec.bits == 8:
        codes[start:start + v.numel()].view(torch.int8).copy_(v)  # integral values: exact
        return
    u = torch.zeros(v.numel() + (v.numel() & 1), dtype=torch.uint8, device=v.device)  # start is even
    u[:v.numel()] = (v + 8).to(torch.uint8)
    codes[start // 2:start // 2 + u.numel() // 2] = u[0::2] | (u[1::2] << 4)


def decode(codec: Codec, buf: torch.Tensor, numel: int, out: torch.Tensor | None = None,
           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ``numel`` values of one encoded chunk (a uint8 tensor) on its device, as ``dtype``
    (fp32 by default, bit-identical to ``Codec.decode``; fp64 gives the exact products)."""
    if buf.numel() != codec.nbytes(numel):
        raise ValueError(f"decode: chunk has {buf.numel()} bytes, {numel} values need {codec.nbytes(numel)}")
    out = torch.empty(numel, dtype=dtype, device=buf.device) if out is None else out
    if numel == 0:
        return out
    sdt = SCALE_DTYPES[codec.scale_dtype]
    sb = codec.blocks(numel) * sdt.itemsize
    scales = buf[:sb].view(sdt).to(out.dtype)
    codes = buf[sb:sb + codec.code_bytes(numel)]
    if codec.bits == 8:
        q = codes.view(torch.int8)
    else:
        q = torch.stack((codes & 0x0F, codes >> 4), dim=1).reshape(-1)[:numel].view(torch.int8) - 8
    full = (numel // codec.block) * codec.block
    nfull = full // codec.block
    if full:
        torch.mul(q[:full].view(-1, codec.block), scales[:nfull, None], out=out[:full].view(-1, codec.block))
    if numel > full:
        torch.mul(q[full:], scales[nfull], out=out[full:])
    return out


def marked(codec: Codec, buf: torch.Tensor, numel: int) -> bool:
    """Whether an encoded chunk carries a block marked as unencodable (a NaN scale)."""
    sdt = SCALE_DTYPES[codec.scale_dtype]
    return bool(torch.isnan(buf[:codec.blocks(numel) * sdt.itemsize].view(sdt)).any())
