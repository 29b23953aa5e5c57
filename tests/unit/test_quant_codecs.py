"""Block codecs: the error bound on adversarial data, layout, policies; a broken codec is caught."""
import numpy as np
import pytest
import torch

from commrt.quant import codecs
from commrt.quant.codecs import Codec, dequantize, quantize

SIZES = [0, 1, 7, 255, 256, 257, 1003]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
CODECS = [Codec(8), Codec(4), Codec(8, 64, "fp16"), Codec(4, 2), Codec(8, 1000)]
EPS = {np.float32: 2.0 ** -23, np.float16: 2.0 ** -10}
TINY = {np.float32: 2.0 ** -149, np.float16: 2.0 ** -24}


def adversarial(n: int, dtype: torch.dtype, kind: str, seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    info = torch.finfo(dtype)
    x = rng.standard_normal(n)
    if kind == "outliers" and n:
        x[rng.integers(0, n, size=max(1, n // 50))] *= 1e4
    elif kind == "zero_blocks":
        x[: n // 2] = 0.0
    elif kind == "subnormal":
        x = x * float(info.smallest_normal) * 0.5  # mostly subnormal in the input dtype
    elif kind == "one_huge" and n:
        x[:] = rng.standard_normal(n) * 1e-3
        x[n // 2] = float(info.max) / 4 if dtype != torch.float64 else 1e30
    elif kind == "constant":
        x[:] = -3.0
    return torch.from_numpy(x).to(dtype)


def reference_scales(x64: np.ndarray, codec: Codec) -> np.ndarray:
    """absmax / qmax per block, computed independently (padding with zeros changes no absmax)."""
    nb = -(-x64.size // codec.block)
    padded = np.zeros(nb * codec.block)
    padded[: x64.size] = np.abs(x64)
    return padded.reshape(nb, codec.block).max(axis=1) / codec.qmax


def check_bound(x: torch.Tensor, codec: Codec, buf: np.ndarray, factor: float = 0.5) -> None:
    """|x - dequant| <= factor * scale per element, scale = absmax / qmax rounded up to the
    scale dtype, plus the rounding of the arithmetic (a few ulp of x in the compute dtype)."""
    x64 = codecs.to_numpy_float(x).astype(np.float64)
    sdt = codecs.SCALE_DTYPES[codec.scale_dtype]
    ref = reference_scales(x64, codec)
    allowed = ref * (1 + 2 * EPS[sdt]) + TINY[sdt]
    stored = buf[: ref.size * np.dtype(sdt).itemsize].view(sdt).astype(np.float64)
    assert np.all(stored >= ref) and np.all(stored <= allowed), "stored scales out of range"
    wide = np.float64 if x.dtype == torch.float64 else np.float32
    got = codec.decode(buf, x64.size, dtype=wide).astype(np.float64)
    per_elem = np.repeat(allowed, codec.block)[: x64.size]
    arith = 4 * float(np.finfo(wide).eps) * np.abs(x64) + float(np.finfo(wide).smallest_subnormal)
    err = np.abs(got - x64)
    over = err > factor * per_elem + arith
    assert not over.any(), (f"{codec}: element {int(np.flatnonzero(over)[0])} error "
                            f"{err[over][0]:.3g} > bound {(factor * per_elem + arith)[over][0]:.3g}")


def encode(x: torch.Tensor, codec: Codec, rng=None) -> np.ndarray:
    values = codecs.to_numpy_float(x)
    buf = np.empty(codec.nbytes(values.size), dtype=np.uint8)
    codec.encode_into(buf, values, rng)
    return buf


@pytest.mark.parametrize("codec", CODECS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["normal", "outliers", "zero_blocks", "subnormal", "one_huge", "constant"])
def test_round_to_nearest_error_is_at_most_half_a_scale(codec, dtype, kind):
    if codec.scale_dtype == "fp16" and kind == "one_huge":
        pytest.skip("beyond fp16 scales: covered by test_fp16_scale_overflow_is_refused")
    for n in SIZES:
        x = adversarial(n, dtype, kind, seed=n)
        check_bound(x, codec, encode(x, codec))


def test_fp16_scale_overflow_is_refused():
    x = torch.tensor([1.0] * 300 + [1e9], dtype=torch.float32)
    with pytest.raises(ValueError, match="block 1: absmax 1e\\+09 .* use scale_dtype fp32"):
        encode(x, Codec(8, 256, "fp16"))


def test_fp16_scale_just_past_the_largest_half_is_refused():
    """absmax / 127 in (65504, 65520) rounds down to 65504 and then up past it: refused, not a
    silent NaN scale (it was before the range check moved after the rounding up)."""
    x = torch.full((4,), 127 * 65510.0, dtype=torch.float32)
    with pytest.raises(ValueError, match="block 0: absmax .* use scale_dtype fp32"):
        encode(x, Codec(8, 256, "fp16"))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_names_the_first_bad_index(bad):
    x = torch.randn(1000)
    x[613] = bad
    x[900] = float("nan")
    with pytest.raises(ValueError, match=f"element 613 is {bad}"):
        encode(x, Codec(4))


def test_marking_instead_of_raising_spoils_only_the_bad_blocks():
    """What a collective does: the bad blocks get a NaN scale (the receiver sees the mark),
    the message names the element by its index in the whole tensor (offset + index)."""
    codec = Codec(8, 100)
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    x[613], x[950] = np.inf, np.nan
    buf = np.empty(codec.nbytes(1000), dtype=np.uint8)
    scale, problem = codec.encode_into(buf, x, offset=5000, mark=True)
    assert problem == "cannot quantize a non-finite value: element 5613 is inf" and scale > 0
    assert codec.marked(buf, 1000) and not codec.marked(encode(torch.from_numpy(x[:600]), codec), 600)
    got = codec.decode(buf, 1000)
    bad = np.zeros(1000, dtype=bool)
    bad[600:700] = bad[900:1000] = True
    assert np.isnan(got[bad]).all() and np.isfinite(got[~bad]).all()


@pytest.mark.parametrize("codec", [Codec(8, rounding="stochastic"), Codec(4, 32, rounding="stochastic")], ids=str)
def test_stochastic_rounding_is_within_one_scale_and_unbiased(codec):
    x = adversarial(1003, torch.float32, "outliers", seed=3)
    rng = np.random.default_rng(7)
    trials = [codec.decode(encode(x, codec, rng), x.numel(), dtype=np.float64) for _ in range(400)]
    for t in trials[:20]:
        assert np.all(np.abs(t - x.double().numpy()) < reference_scales(x.double().numpy(), codec).repeat(codec.block)
                      [: x.numel()] * (1 + 1e-6) + 1e-30)
    scale = reference_scales(x.double().numpy(), codec).repeat(codec.block)[: x.numel()]
    bias = np.abs(np.mean(trials, axis=0) - x.double().numpy())
    # the mean of 400 draws of a value in {floor, floor + s} has standard deviation <= s / 40
    assert np.all(bias <= scale / 40 * 5 + 1e-30), bias.max()
    nearest = Codec(codec.bits, codec.block)
    biased = np.abs(nearest.decode(encode(x, nearest), x.numel(), dtype=np.float64) - x.double().numpy())
    assert bias.mean() < biased.mean() / 3  # rounding to nearest keeps its bias; stochastic averages it out


def test_broken_codecs_are_caught(monkeypatch):
    """The checker is not vacuous: truncating instead of rounding, or scales twice too large,
    both fail it."""
    x = adversarial(1003, torch.float32, "normal", seed=1)
    monkeypatch.setattr(Codec, "_round", lambda self, v, rng: np.trunc(v, out=v))
    with pytest.raises(AssertionError, match="error .* > bound"):
        check_bound(x, Codec(8), encode(x, Codec(8)))
    monkeypatch.undo()
    original = Codec._scales

    def doubled(self, rows, offset):
        s, problem = original(self, rows, offset)
        return s * 2, problem
    monkeypatch.setattr(Codec, "_scales", doubled)
    with pytest.raises(AssertionError, match="stored scales out of range"):
        check_bound(x, Codec(8), encode(x, Codec(8)))


@pytest.mark.parametrize("n", [0, 1, 2, 255, 256, 257, 70001])
def test_encoded_size_scales_included(n):
    for codec, code_bytes in ((Codec(8), n), (Codec(4), (n + 1) // 2), (Codec(8, 256, "fp16"), n)):
        scale_bytes = -(-n // 256) * (2 if codec.scale_dtype == "fp16" else 4)
        assert codec.nbytes(n) == (scale_bytes + code_bytes + 3) // 4 * 4
    if n >= 70001:  # the targets: int8 <= 0.26x, int4 <= 0.135x fp32, scales included
        assert Codec(8).nbytes(n) / (4 * n) <= 0.26
        assert Codec(4).nbytes(n) / (4 * n) <= 0.135


def test_int4_packs_two_codes_per_byte_low_nibble_first():
    x = torch.tensor([7.0, -7.0, 0.0, 1.0, -1.0], dtype=torch.float32)
    buf = encode(x, Codec(4, 8))
    assert buf[:4].view(np.float32)[0] == 1.0
    assert list(buf[4:7]) == [(7 + 8) | ((-7 + 8) << 4), (0 + 8) | ((1 + 8) << 4), (-1 + 8)]


def test_bf16_and_fp16_conversions_round_trip():
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(1001).to(dtype)
        out = torch.empty_like(x)
        codecs.store_float(out, codecs.to_numpy_float(x))
        assert torch.equal(out, x)
    wide = torch.randn(1001, dtype=torch.float32)
    out = torch.empty(1001, dtype=torch.bfloat16)
    codecs.store_float(out, wide.numpy())
    assert torch.equal(out, wide.to(torch.bfloat16))  # same rounding as torch (nearest even)


def test_functional_api_and_bad_arguments():
    x = torch.randn(300, dtype=torch.float16)
    y = dequantize(quantize(x, "int4", block=64), 300, "int4", block=64, dtype=torch.float16)
    assert y.dtype == torch.float16 and (y.float() - x.float()).abs().max() < 0.5
    for kwargs, msg in (({"quant": "int2"}, "valid: \\['int8', 'int4'\\]"), ({"block": 3}, "even integer"),
                        ({"scale_dtype": "bf16"}, "valid: \\['fp32', 'fp16'\\]"),
                        ({"rounding": "up"}, "valid: \\['nearest', 'stochastic'\\]")):
        with pytest.raises(ValueError, match=msg):
            quantize(x, **kwargs)
    with pytest.raises(TypeError, match="float tensors"):
        quantize(torch.ones(3, dtype=torch.int32))


def test_an_fp32_scale_overflow_does_not_advise_fp32():
    """issue 30 item 15: the advice was "use scale_dtype fp32" when it already was fp32."""
    x = torch.full((4,), 1e300, dtype=torch.float64)
    with pytest.raises(ValueError, match="beyond fp32's range; no scale dtype holds it") as info:
        encode(x, Codec(8, 256, "fp32"))
    assert "use scale_dtype fp32" not in str(info.value)
