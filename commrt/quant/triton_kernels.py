"""Fused Triton kernels for the block codec of codecs.py: one pass over memory to encode (block
absmax, scale, round, pack) and one to decode (unpack, scale, optionally add into an fp32
accumulator). Imported only by ``fused`` and only where Triton imports (see fused.py).

The bytes and values are the numpy codec's bit for bit, so every step that rounds is written
as the one IEEE instruction numpy's step is: Triton's own fp32 ``/`` is ``div.full.f32`` (an
approximation, up to 2 ulp off), its compiler may contract ``a * b + c`` into an FMA, and its
libdevice calls may flush subnormals, so the rounding steps are inline PTX: ``div.rn.f32``,
``mul.rn.f32``, ``add.rn.f32`` and ``cvt.rni.f32.f32`` (round half to even, ``np.rint``), none
with ``.ftz``. The block absmax is taken on the bit patterns (``|x|`` as an integer orders as
the float does; NaN and inf sort above every finite value), so no float compare can flush a
subnormal or drop a NaN. A block that cannot be encoded gets a non-finite scale here; the
caller sees it and hands the chunk to the reference codec, which names or marks the block (as
it does a block at float32's largest value, whose finite scale x qmax overflows: fused.py).

``FAST`` (issue 34, round 2) replaces the per-element ``div.rn`` by one ``rcp.rn`` a row and a
``mul.rn`` an element, y = RN(x * RN(1/s)), and keeps the exact division only where it could
round differently. Why that is exact: with u = 2^-24, r = 1/s (1 + d1), y = x r (1 + d2) and
fl(x / s) = x / s (1 + d3), |di| <= u, so |y - fl(x / s)| <= |x / s| (3u + u^2) < |y| 2^-22
while r and y are normal (s in [2^-125, 2^125]; a subnormal y is < 2^-126, far from any tie).
If y is farther than |y| 2^-21 from the nearest half-integer m, fl(x / s) lies strictly on y's
side of m, between the same two half-integers, so rint gives the same integer. ``0.5 - |y -
rint(y)|`` (that distance) is exact near m (Sterbenz). Any lane not shown far (a tie, NaN, inf,
a row with s out of range) makes its tile take ``div.rn`` for those lanes: a branch per tile,
not per lane, so ordinary tiles never run the division.
"""
from __future__ import annotations

import triton
import triton.language as tl

_INF_BITS = 0x7F800000


@triton.jit
def _div_rn(a, b):
    return tl.inline_asm_elementwise("div.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32,
                                     is_pure=True, pack=1)


@triton.jit
def _mul_rn(a, b):
    return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32,
                                     is_pure=True, pack=1)


@triton.jit
def _add_rn(a, b):
    return tl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32,
                                     is_pure=True, pack=1)


@triton.jit
def _rint(a):
    return tl.inline_asm_elementwise("cvt.rni.f32.f32 $0, $1;", "=f,f", [a], dtype=tl.float32,
                                     is_pure=True, pack=1)


@triton.jit
def _rcp_rn(a):
    return tl.inline_asm_elementwise("rcp.rn.f32 $0, $1;", "=f,f", [a], dtype=tl.float32,
                                     is_pure=True, pack=1)


@triton.jit
def _quantize(x, div, ROWS: tl.constexpr, COLS: tl.constexpr, FAST: tl.constexpr):
    """rint(fl(x / div)) of a [ROWS, COLS] tile, div one per row (fp32, round half to even)."""
    d = tl.broadcast_to(div[:, None], [ROWS, COLS])
    if FAST:
        y = _mul_rn(x, tl.broadcast_to(_rcp_rn(div)[:, None], [ROWS, COLS]))
        q = _rint(y)
        far = (0.5 - tl.abs(y - q)) > tl.abs(y) * 4.76837158203125e-07  # 2^-21
        far = far & tl.broadcast_to(((div >= 2.350988701644575e-38) & (div <= 4.253529586511731e+37))[:, None],
                                    [ROWS, COLS])  # 2^-125, 2^125: r normal
        if tl.min(far.to(tl.int32)) == 0:
            q = tl.where(far, q, _rint(_div_rn(x, d)))
    else:
        q = _rint(_div_rn(x, d))
    return q


@triton.jit
def _abs_bits(x):
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _scale(mbits, QMAX: tl.constexpr, FP16: tl.constexpr):
    """(the scale to store, the fp32 divisor) of rows whose absmax has bits ``mbits``: absmax /
    qmax in fp64, rounded to the scale dtype, then up one step where that rounding went down
    (codecs.Codec._scales). fp16 goes through fp32 as torch's conversion does; the step up
    gives the smallest fp16 >= absmax / qmax either way."""
    exact = mbits.to(tl.float32, bitcast=True).to(tl.float64) / QMAX
    s = exact.to(tl.float32)
    if FP16:
        h = s.to(tl.float16)
        up = (h.to(tl.float64) < exact).to(tl.int16)
        h = (h.to(tl.int16, bitcast=True) + up).to(tl.float16, bitcast=True)
        s32 = h.to(tl.float32)
        stored = h
    else:
        up = (s.to(tl.float64) < exact).to(tl.int32)
        s32 = (s.to(tl.int32, bitcast=True) + up).to(tl.float32, bitcast=True)
        stored = s32
    return stored, tl.where(s32 == 0, 1.0, s32)


@triton.jit(do_not_specialize=["n"])  # one compile for every length
def _encode8_kernel(x_ptr, scale_ptr, code_ptr, n, BLOCK: tl.constexpr, QMAX: tl.constexpr,
                    FP16: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr, NT: tl.constexpr,
                    FAST: tl.constexpr):
    """int8: ROWS blocks per program, each read as NT tiles of COLS elements (one tile, read
    once, for blocks up to COLS; larger blocks are read twice, once for the absmax)."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, COLS)
    mbits = tl.zeros([ROWS], dtype=tl.int32)
    if NT == 1:
        idx = rows[:, None] * BLOCK + cols[None, :]
        ok = (cols[None, :] < BLOCK) & (idx < n)
        x = tl.load(x_ptr + idx, mask=ok, other=0.0).to(tl.float32)
        stored, div = _scale(tl.max(_abs_bits(x), axis=1), QMAX, FP16)
        tl.store(scale_ptr + rows, stored, mask=rows * BLOCK < n)
        q = _quantize(x, div, ROWS, COLS, FAST)
        tl.store(code_ptr + idx, q.to(tl.int8), mask=ok)
    else:
        for t in range(NT):
            c = t * COLS + cols
            idx = rows[:, None] * BLOCK + c[None, :]
            x = tl.load(x_ptr + idx, mask=(c[None, :] < BLOCK) & (idx < n), other=0.0).to(tl.float32)
            mbits = tl.maximum(mbits, tl.max(_abs_bits(x), axis=1))
        stored, div = _scale(mbits, QMAX, FP16)
        tl.store(scale_ptr + rows, stored, mask=rows * BLOCK < n)
        for t in range(NT):
            c = t * COLS + cols
            idx = rows[:, None] * BLOCK + c[None, :]
            ok = (c[None, :] < BLOCK) & (idx < n)
            x = tl.load(x_ptr + idx, mask=ok, other=0.0).to(tl.float32)
            q = _quantize(x, div, ROWS, COLS, FAST)
            tl.store(code_ptr + idx, q.to(tl.int8), mask=ok)


@triton.jit
def _load_pairs(x_ptr, rows, p0, n, BLOCK: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
                SPLIT: tl.constexpr):
    """Elements 2p and 2p + 1 of each row, p = p0 ... p0 + COLS - 1, as fp32 [ROWS, COLS]
    tensors (0 past the row or n): one contiguous load split in two, or (SPLIT false) two
    strided loads. Also returns the even elements' indices and p."""
    p = p0 + tl.arange(0, COLS)
    even = rows[:, None] * BLOCK + 2 * p[None, :]
    if SPLIT:
        c2 = 2 * p0 + tl.arange(0, 2 * COLS)
        idx = rows[:, None] * BLOCK + c2[None, :]
        x = tl.load(x_ptr + idx, mask=(c2[None, :] < BLOCK) & (idx < n), other=0.0).to(tl.float32)
        xe, xo = tl.split(tl.reshape(x, [ROWS, COLS, 2]))
    else:
        inrow = p[None, :] < BLOCK // 2
        xe = tl.load(x_ptr + even, mask=inrow & (even < n), other=0.0).to(tl.float32)
        xo = tl.load(x_ptr + even + 1, mask=inrow & (even + 1 < n), other=0.0).to(tl.float32)
    return xe, xo, even, p


@triton.jit
def _store_pairs(code_ptr, xe, xo, even, p, n, div, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                 COLS: tl.constexpr, FAST: tl.constexpr):
    """One byte per pair: element 2i + 8 in the low nibble, 2i + 1 (+ 8, or 0 past n) high."""
    lo = _quantize(xe, div, ROWS, COLS, FAST).to(tl.int32) + 8
    hi = tl.where(even + 1 < n, _quantize(xo, div, ROWS, COLS, FAST).to(tl.int32) + 8, 0)
    ok = (p[None, :] < BLOCK // 2) & (even < n)
    tl.store(code_ptr + even // 2, (lo | (hi << 4)).to(tl.uint8), mask=ok)


@triton.jit(do_not_specialize=["n"])  # one compile for every length
def _encode4_kernel(x_ptr, scale_ptr, code_ptr, n, BLOCK: tl.constexpr, QMAX: tl.constexpr,
                    FP16: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr, NT: tl.constexpr,
                    SPLIT: tl.constexpr, FAST: tl.constexpr):
    """int4: as _encode8_kernel, over pairs of elements (COLS pairs a tile); block is even, so
    a row's codes start at byte row * BLOCK / 2."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    mbits = tl.zeros([ROWS], dtype=tl.int32)
    if NT == 1:
        xe, xo, even, p = _load_pairs(x_ptr, rows, 0, n, BLOCK, ROWS, COLS, SPLIT)
        mbits = tl.maximum(tl.max(_abs_bits(xe), axis=1), tl.max(_abs_bits(xo), axis=1))
        stored, div = _scale(mbits, QMAX, FP16)
        tl.store(scale_ptr + rows, stored, mask=rows * BLOCK < n)
        _store_pairs(code_ptr, xe, xo, even, p, n, div, BLOCK, ROWS, COLS, FAST)
    else:
        for t in range(NT):
            xe, xo, even, p = _load_pairs(x_ptr, rows, t * COLS, n, BLOCK, ROWS, COLS, SPLIT)
            mbits = tl.maximum(mbits, tl.maximum(tl.max(_abs_bits(xe), axis=1), tl.max(_abs_bits(xo), axis=1)))
        stored, div = _scale(mbits, QMAX, FP16)
        tl.store(scale_ptr + rows, stored, mask=rows * BLOCK < n)
        for t in range(NT):
            xe, xo, even, p = _load_pairs(x_ptr, rows, t * COLS, n, BLOCK, ROWS, COLS, SPLIT)
            _store_pairs(code_ptr, xe, xo, even, p, n, div, BLOCK, ROWS, COLS, FAST)


@triton.jit(do_not_specialize=["n"])  # one compile for every length
def _decode8_kernel(code_ptr, scale_ptr, out_ptr, acc_ptr, n, BLOCK: tl.constexpr, TILE: tl.constexpr,
                    ACC: tl.constexpr):
    """out = q * s (fp32, one rounding), or with ACC acc = acc + q * s (two roundings, as
    numpy's decode then ``+=``)."""
    idx = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    ok = idx < n
    q = tl.load(code_ptr + idx, mask=ok, other=0).to(tl.float32)
    s = tl.load(scale_ptr + idx // BLOCK, mask=ok, other=0.0).to(tl.float32)
    v = _mul_rn(q, s)
    if ACC:
        v = _add_rn(tl.load(acc_ptr + idx, mask=ok, other=0.0), v)
        tl.store(acc_ptr + idx, v, mask=ok)
    else:
        tl.store(out_ptr + idx, v, mask=ok)


@triton.jit(do_not_specialize=["n"])  # one compile for every length
def _decode4_kernel(code_ptr, scale_ptr, out_ptr, acc_ptr, n, BLOCK: tl.constexpr, TILE: tl.constexpr,
                    ACC: tl.constexpr, SPLIT: tl.constexpr):
    """int4: TILE bytes (2 * TILE values) a program; both nibbles of a byte share a block."""
    j = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    ok = 2 * j < n
    b = tl.load(code_ptr + j, mask=ok, other=0).to(tl.int32)
    s = tl.load(scale_ptr + (2 * j) // BLOCK, mask=ok, other=0.0).to(tl.float32)
    v0 = _mul_rn(((b & 15) - 8).to(tl.float32), s)
    v1 = _mul_rn(((b >> 4) - 8).to(tl.float32), s)
    dst = acc_ptr if ACC else out_ptr
    if SPLIT:
        idx = tl.program_id(0).to(tl.int64) * (2 * TILE) + tl.arange(0, 2 * TILE)
        v = tl.reshape(tl.join(v0, v1), [2 * TILE])
        if ACC:
            v = _add_rn(tl.load(acc_ptr + idx, mask=idx < n, other=0.0), v)
        tl.store(dst + idx, v, mask=idx < n)
    else:
        if ACC:
            v0 = _add_rn(tl.load(acc_ptr + 2 * j, mask=ok, other=0.0), v0)
            v1 = _add_rn(tl.load(acc_ptr + 2 * j + 1, mask=2 * j + 1 < n, other=0.0), v1)
        tl.store(dst + 2 * j, v0, mask=ok)
        tl.store(dst + 2 * j + 1, v1, mask=2 * j + 1 < n)
