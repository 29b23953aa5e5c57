"""The fused codec (fused.py, triton_kernels.py) against the numpy codec. On the CPU: which path
a tensor takes and why, the tile plan, and the fallbacks (no Triton, a block the kernel cannot
encode). With CUDA and Triton (``cuda``): the kernels' bytes and decoded values, bit for bit,
for every kind of input the torch codec's cross-codec test uses, block sizes from 2 to 65536,
int8 and int4, odd lengths, fp32 / fp16 / bf16 values."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from commrt.quant import codecs, fused, kernels, torch_codec
from commrt.quant.codecs import Codec
from tests.unit.test_quant_codecs import adversarial
from tests.unit.test_quant_torch_codec import CODECS, KINDS, SIZES, numpy_encode

FUSED_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BLOCKS = [2, 6, 30, 256, 1000, 4096, 4098, 65536]
LENGTHS = [1, 3, 255, 257, 4097, 65537, 200_001]


def _triton_on_cuda() -> bool:
    return torch.cuda.is_available() and fused.unfit(Codec(8), torch.empty(1, device="cuda")) is None


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
gpu_triton = [pytest.mark.cuda, cuda]


def test_cpu_fp64_and_stochastic_take_the_torch_codec_and_say_why():
    assert "cpu tensor" in fused.unfit(Codec(8), torch.ones(3))
    meta = torch.ones(3, device="meta")
    assert "meta tensor" in fused.unfit(Codec(8), meta)
    if torch.cuda.is_available():
        assert "float64" in fused.unfit(Codec(8), torch.ones(3, dtype=torch.float64, device="cuda"))
        assert "stochastic" in fused.unfit(Codec(8, rounding="stochastic"), torch.ones(3, device="cuda"))


def test_without_triton_the_reason_names_the_import_error(monkeypatch):
    monkeypatch.setattr(fused, "_state", {"module": None, "why": "triton is not importable (ImportError: x)"})
    monkeypatch.setattr(fused, "_kernels", lambda: None)
    fake_cuda = SimpleNamespace(device=torch.device("cuda"), dtype=torch.float32)  # all unfit reads
    assert fused.unfit(Codec(8), fake_cuda) == "triton is not importable (ImportError: x)"


def test_turned_off_is_a_reason(monkeypatch):
    monkeypatch.setattr(fused, "_state", {})
    fused.set_enabled(False)
    assert fused.unfit(Codec(8), torch.ones(3)) == "turned off"
    fused.set_enabled(True)
    assert fused.unfit(Codec(8), torch.ones(3)) != "turned off"


@pytest.mark.parametrize("bits", [8, 4])
def test_encode_plan_covers_each_block_with_power_of_two_tiles(bits):
    for block in list(range(2, 300, 2)) + [1000, 2048, 4096, 4098, 65536, 1 << 20, 1_000_002]:
        for tile in (1024, 4096, 8192):
            rows, cols, tiles = fused.encode_plan(Codec(bits, block), tile)
            units = block // (2 if bits == 4 else 1)
            assert cols >= 2 and cols & (cols - 1) == 0 and rows & (rows - 1) == 0, (block, rows, cols)
            assert (tiles - 1) * cols < units <= tiles * cols, (block, cols, tiles)
            assert rows * cols * (2 if bits == 4 else 1) <= max(tile, 2 * fused.MAX_COLS)


@pytest.mark.parametrize("codec", [Codec(8), Codec(4, 6, "fp16")], ids=str)
def test_cpu_tensors_give_the_numpy_bytes_through_the_fallback(codec):
    x = adversarial(1003, torch.bfloat16, "outliers", seed=1)
    out = torch.empty(codec.nbytes(1003), dtype=torch.uint8)
    scale, problem = fused.encode_into(codec, out, x)
    want, (want_scale, _) = numpy_encode(x, codec)
    assert np.array_equal(out.numpy(), want) and scale == want_scale and problem is None
    acc = torch.ones(1003)
    fused.decode_add(codec, out, 1003, acc)
    assert np.array_equal(acc.numpy(), np.float32(1) + codec.decode(want, 1003))
    assert np.array_equal(fused.decode(codec, out, 1003).numpy(), codec.decode(want, 1003))


class _NaNScales:
    """Stands in for a kernel that met a bad block: it leaves a NaN scale and junk codes."""

    def __getitem__(self, grid):
        def launch(x, scales, codes, n, **kw):
            scales.fill_(float("nan"))
            codes.fill_(0x55)
        return launch


def test_a_block_the_kernel_cannot_encode_is_encoded_again_by_the_reference(monkeypatch):
    fake = type("K", (), {"_encode8_kernel": _NaNScales(), "_encode4_kernel": _NaNScales()})
    monkeypatch.setattr(fused, "_kernels", lambda: fake)
    monkeypatch.setattr(fused, "unfit", lambda codec, t: None)
    for codec in (Codec(8, 100), Codec(4, 100, "fp16")):
        x = torch.randn(1003)
        x[613] = float("inf")
        out = torch.empty(codec.nbytes(1003), dtype=torch.uint8)
        got_scale, got_msg = fused.encode_into(codec, out, x, mark=True)
        want, (want_scale, want_msg) = numpy_encode(x, codec, mark=True)
        assert np.array_equal(out.numpy(), want) and got_scale == want_scale and got_msg == want_msg
        with pytest.raises(ValueError, match="element 613 is inf"):
            fused.encode_into(codec, out, x)


def test_host_and_device_decode_add_sum_as_decode_then_add():
    codec = Codec(4, 64)
    x = adversarial(999, torch.float32, "normal", seed=2)
    buf, _ = numpy_encode(x, codec)
    acc = np.full(999, 0.1, dtype=np.float32)
    kernels.Host.decode_add(codec, buf, 999, acc)
    assert np.array_equal(acc, np.float32(0.1) + codec.decode(buf, 999))
    tacc = torch.full((999,), 0.1)
    kernels.Device.decode_add(codec, torch.from_numpy(buf), 999, tacc)
    assert np.array_equal(tacc.numpy(), acc)


# ---- on a GPU: the kernels themselves, compared with numpy bit for bit --------------------

def _fused_encode(x: torch.Tensor, codec: Codec):
    buf = torch.full((codec.nbytes(x.numel()),), 0xAB, dtype=torch.uint8, device="cuda")  # junk to overwrite
    return buf, fused.encode_into(codec, buf, x.to("cuda"))


def assert_fused_identical(x: torch.Tensor, codec: Codec) -> None:
    want, (want_scale, _) = numpy_encode(x, codec)
    got, (got_scale, problem) = _fused_encode(x, codec)
    assert problem is None and got_scale == want_scale, (codec, x.dtype, x.numel(), got_scale, want_scale)
    got = got.cpu().numpy()
    if not np.array_equal(got, want):
        i = int(np.flatnonzero(got != want)[0])
        raise AssertionError(f"{codec} {x.dtype} n={x.numel()}: byte {i} of {want.size} is {got[i]}, numpy's {want[i]}")
    n = x.numel()
    ref = codec.decode(want, n)
    dev = torch.from_numpy(want).to("cuda")
    assert np.array_equal(fused.decode(codec, dev, n).cpu().numpy(), ref, equal_nan=True), f"{codec} decode n={n}"
    acc = torch.linspace(-1, 1, n, device="cuda")
    want_acc = acc.cpu().numpy() + ref
    fused.decode_add(codec, dev, n, acc)
    assert np.array_equal(acc.cpu().numpy(), want_acc), f"{codec} decode_add n={n}"


@pytest.fixture(params=["split", "strided", "fast"])
def split(request, monkeypatch):
    """int4's two layouts, and (fast) the encode with a reciprocal a row."""
    if not _triton_on_cuda():
        pytest.skip("needs CUDA and Triton")
    monkeypatch.setattr(fused, "SPLIT", request.param != "strided")
    monkeypatch.setattr(fused, "FAST", request.param == "fast")
    return request.param != "strided"


def fast_rint(x: np.ndarray, s: np.float32, tol: float = 2.0 ** -21) -> tuple[np.ndarray, np.ndarray]:
    """The FAST encode's arithmetic in numpy fp32 (each op rounds once, as the kernel's PTX):
    (rint of y = x * (1/s), which lanes it trusts). The kernel divides the others exactly."""
    with np.errstate(all="ignore"):
        r = np.float32(1) / s
        y = (x * r).astype(np.float32)
        q = np.rint(y)
        far = (np.float32(0.5) - np.abs(y - q)) > np.abs(y) * np.float32(tol)
        far &= bool(2.0 ** -125 <= s <= 2.0 ** 125)
    return q, far


def test_fast_encode_trusts_only_lanes_that_round_as_the_exact_division():
    """The proof in triton_kernels' docstring, checked on values made to sit at and beside
    rounding ties (x = (k + 1/2) s, nudged by a few ulps), across scales from tiny to huge.
    With no tolerance (tol=0) it fails: y and x / s round apart at some near-ties."""
    rng = np.random.default_rng(7)
    wrong_without_tol = 0
    for s in [np.float32(v) for v in (1.0, 1 / 127, 3.3e-3, 0.1, 7.7e-30, 1.1e30, 2.0 ** -124, 2.0 ** 120)]:
        k = rng.integers(-127, 127, 200_000).astype(np.float32)
        x = ((k + np.float32(0.5)) * s).astype(np.float32)
        x = np.nextafter(x, np.float32(np.inf) * rng.choice([-1, 1], x.size), dtype=np.float32)
        x[::3] = ((k[::3] + np.float32(0.5)) * s).astype(np.float32)
        normal = (rng.standard_normal(100_000) * 40 * s).astype(np.float32)
        x = np.concatenate([x, normal])
        x = x[np.abs(x) <= np.float32(127) * s]
        exact = np.rint((x / s).astype(np.float32))
        q, far = fast_rint(x, s)
        assert np.array_equal(q[far], exact[far]), s
        assert fast_rint(normal, s)[1].mean() > 0.999, s  # ordinary values skip the division
        q0, far0 = fast_rint(x, s, tol=0.0)
        wrong_without_tol += int((q0[far0] != exact[far0]).sum())
    assert wrong_without_tol > 0


@pytest.mark.parametrize("codec", CODECS, ids=str)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.cuda
@cuda
def test_fused_bytes_and_values_identical_to_numpy(codec, kind, split):
    if codec.bits == 8 and not split:
        pytest.skip("int8 has no pairs to split")
    for dtype in FUSED_DTYPES if split else [torch.float32]:
        if codec.scale_dtype == "fp16" and kind == "one_huge":
            continue  # refused: the fallback test names it
        for n in SIZES:
            assert_fused_identical(adversarial(n, dtype, kind, seed=n), codec)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.cuda
@cuda
def test_every_block_size_and_odd_lengths(bits, block, split):
    if bits == 8 and not split:
        pytest.skip("int8 has no pairs to split")
    for scale_dtype in ("fp32", "fp16"):
        for n in LENGTHS:
            assert_fused_identical(adversarial(n, torch.float32, "outliers", seed=n + block), Codec(bits, block, scale_dtype))
    assert_fused_identical(adversarial(block + 1, torch.bfloat16, "normal"), Codec(bits, block))


class _RoundedUpScales:
    """Stands in for the kernel on a block at float32's largest value: it stores that block's
    scale as the kernel does (absmax / qmax in fp64, to fp32, up one step where that went
    down), finite, and junk codes. 127 x that scale overflows float32 on decode."""

    def __getitem__(self, grid):
        def launch(x, scales, codes, n, BLOCK, QMAX, **kw):
            pad = torch.zeros(scales.numel() * BLOCK, dtype=torch.float64)
            pad[:n] = x.double().abs()
            exact = pad.view(-1, BLOCK).amax(dim=1) / QMAX
            s = exact.float()
            s = torch.where(s.double() < exact, torch.nextafter(s, torch.tensor(float("inf"))), s)
            scales.copy_(s)
            codes.fill_(0x55)
        return launch


def test_a_block_whose_scale_decodes_past_float32_is_encoded_again_by_the_reference(monkeypatch):
    """The kernel's scale for a block at float32's largest value is finite, but 127 x it is
    not: the fused path kept it, and the value decoded to inf where the numpy and torch codecs
    mark the block (a67e904). encode_into now checks qmax x the largest scale, which it reads
    back anyway."""
    fake = type("K", (), {"_encode8_kernel": _RoundedUpScales(), "_encode4_kernel": _RoundedUpScales()})
    monkeypatch.setattr(fused, "_kernels", lambda: fake)
    monkeypatch.setattr(fused, "unfit", lambda codec, t: None)
    x = torch.tensor([float(np.finfo(np.float32).max), 1.0, -3.0, 0.5])
    for codec in (Codec(8, 2), Codec(8, 4)):  # int4's scale, x 7, stays finite
        out = torch.empty(codec.nbytes(4), dtype=torch.uint8)
        got_scale, got_msg = fused.encode_into(codec, out, x, mark=True)
        want, (want_scale, want_msg) = numpy_encode(x, codec, mark=True)
        assert want_msg and "block 0" in want_msg and codec.marked(want, 4), codec
        assert np.array_equal(out.numpy(), want) and got_scale == want_scale and got_msg == want_msg
        assert not np.isinf(codec.decode(out.numpy(), 4)).any()


@pytest.mark.cuda
@cuda
def test_fused_marks_a_block_at_float32s_largest_value(split):
    x = torch.tensor([float(np.finfo(np.float32).max), 1.0, -3.0, 0.5] * 1000)
    for codec in (Codec(8, 2), Codec(4, 2), Codec(8, 256)):
        got = torch.empty(codec.nbytes(x.numel()), dtype=torch.uint8, device="cuda")
        scale, msg = fused.encode_into(codec, got, x.cuda(), mark=True)
        want, (want_scale, want_msg) = numpy_encode(x, codec, mark=True)
        assert (want_msg is not None) == (codec.bits == 8)  # int4's scale, x 7, stays finite
        assert np.array_equal(got.cpu().numpy(), want) and scale == want_scale and msg == want_msg


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_fused_errors_and_marks_are_the_references(bad, split):
    x = torch.randn(300_000)
    x[200_013] = bad
    for codec in (Codec(4), Codec(8, 256, "fp16")):
        with pytest.raises(ValueError) as info:
            _fused_encode(x, codec)
        assert "element 200013 is " + str(bad) in str(info.value)
        got = torch.empty(codec.nbytes(x.numel()), dtype=torch.uint8, device="cuda")
        scale, msg = fused.encode_into(codec, got, x.cuda(), mark=True)
        want, (want_scale, want_msg) = numpy_encode(x, codec, mark=True)
        assert np.array_equal(got.cpu().numpy(), want) and scale == want_scale and msg == want_msg
    edge = torch.full((4,), 127 * 65510.0)  # rounds down to 65504, then up past it: refused
    with pytest.raises(ValueError, match="use scale_dtype fp32"):
        _fused_encode(edge, Codec(8, 256, "fp16"))


@pytest.mark.cuda
@cuda
def test_fused_ties_round_half_to_even_and_views_encode_their_values(split):
    x = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5])
    buf, _ = _fused_encode(x, Codec(8))
    assert buf.cpu().numpy()[4:12].view(np.int8).tolist() == [127, 0, 2, 2, 0, -2, -2, 126]
    y = torch.randn(400, 50, device="cuda").t()[:, ::3]
    got, _ = _fused_encode(y, Codec(4, 6))
    assert np.array_equal(got.cpu().numpy(), numpy_encode(y.cpu().contiguous(), Codec(4, 6))[0])


@pytest.mark.cuda
@cuda
def test_device_kernels_take_the_fused_path_for_cuda_tensors(split, monkeypatch):
    calls = []
    real = torch_codec.encode_into
    monkeypatch.setattr(torch_codec, "encode_into", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.randn(5000, device="cuda")
    codec = Codec(8)
    out = kernels.Device.empty_bytes(codec.nbytes(5000), x)
    kernels.Device.encode(codec, out, x, 0)
    assert not calls  # the torch codec was not asked
    assert np.array_equal(out.cpu().numpy(), numpy_encode(x.cpu(), codec)[0])
    assert codecs.Codec(8).nbytes(5000) == out.numel()
