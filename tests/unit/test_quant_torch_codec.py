"""The torch codec against the numpy one: the same bytes and the same decoded values (what keeps
ranks with CUDA tensors and ranks with CPU tensors bit-identical), its error bound, its errors.
The CPU runs test the torch kernels themselves; the ``cuda`` ones repeat the checks on a GPU."""
import numpy as np
import pytest
import torch

from commrt.quant import codecs, torch_codec
from commrt.quant.codecs import Codec
from tests.unit.test_quant_codecs import adversarial, check_bound

SIZES = [0, 1, 7, 255, 256, 257, 1003, 70001]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
KINDS = ["normal", "outliers", "zero_blocks", "subnormal", "one_huge", "constant"]
CODECS = [Codec(8), Codec(4), Codec(8, 64, "fp16"), Codec(4, 256, "fp16"), Codec(4, 2), Codec(8, 2, "fp16"),
          Codec(8, 1000), Codec(4, 6)]
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])]


def numpy_encode(x: torch.Tensor, codec: Codec, mark: bool = False):
    values = codecs.to_numpy_float(x)
    buf = np.empty(codec.nbytes(values.size), dtype=np.uint8)
    return buf, codec.encode_into(buf, values, mark=mark)


def torch_encode(x: torch.Tensor, codec: Codec, device: str, mark: bool = False, generator=None):
    buf = torch.full((codec.nbytes(x.numel()),), 0xAB, dtype=torch.uint8, device=device)  # junk to overwrite
    return buf, torch_codec.encode_into(codec, buf, x.to(device), generator, mark=mark)


def assert_identical(x: torch.Tensor, codec: Codec, device: str) -> None:
    want, (want_scale, _) = numpy_encode(x, codec)
    got, (got_scale, problem) = torch_encode(x, codec, device)
    assert problem is None and got_scale == want_scale, (got_scale, want_scale)
    got = got.cpu().numpy()
    if not np.array_equal(got, want):
        i = int(np.flatnonzero(got != want)[0])
        raise AssertionError(f"{codec} {x.dtype} n={x.numel()}: byte {i} of {want.size} is {got[i]}, numpy's {want[i]}")
    n = x.numel()
    for wide, npwide in ((torch.float32, np.float32), (torch.float64, np.float64)):
        decoded = torch_codec.decode(codec, torch.from_numpy(want).to(device), n, dtype=wide).cpu().numpy()
        assert np.array_equal(decoded, codec.decode(want, n, dtype=npwide)), f"{codec} decode {wide} n={n}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codec", CODECS, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_bytes_and_decoded_values_identical_to_numpy(device, codec, kind):
    for dtype in DTYPES:
        if codec.scale_dtype == "fp16" and kind == "one_huge":
            continue  # refused: test_errors_name_the_same_element_as_numpy
        for n in SIZES:
            assert_identical(adversarial(n, dtype, kind, seed=n), codec, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codec", [Codec(8), Codec(4, 64, "fp16")], ids=str)
def test_error_bound_nearest_and_stochastic(device, codec):
    gen = torch.Generator(device=device).manual_seed(1)
    for dtype in DTYPES:
        for n in (1, 257, 70001):
            x = adversarial(n, dtype, "outliers", seed=n)
            buf, _ = torch_encode(x, codec, device)
            check_bound(x, codec, buf.cpu().numpy(), factor=0.5)
            stochastic = Codec(codec.bits, codec.block, codec.scale_dtype, "stochastic")
            buf, _ = torch_encode(x, stochastic, device, generator=gen)
            check_bound(x, stochastic, buf.cpu().numpy(), factor=1.0)


@pytest.mark.parametrize("device", DEVICES)
def test_stochastic_rounding_is_unbiased(device):
    codec = Codec(4, 64, rounding="stochastic")
    gen = torch.Generator(device=device).manual_seed(0)
    x = adversarial(256, torch.float32, "normal", seed=3)
    mean = sum(torch_codec.decode(codec, torch_encode(x, codec, device, generator=gen)[0], 256, dtype=torch.float64)
               for _ in range(400)) / 400
    scale = float(x.abs().max()) / 7
    assert float((mean.cpu() - x.double()).abs().max()) < 0.2 * scale  # one draw errs up to a whole scale


def _error_of(fn) -> str:
    with pytest.raises(ValueError) as info:
        fn()
    return str(info.value)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_errors_name_the_same_element_as_numpy(device, bad):
    x = torch.randn(300_000)  # three CPU slabs: the first bad one is found in the second
    x[200_013], x[250_000], x[290_000] = bad, float("nan"), 1e9
    for codec in (Codec(4), Codec(8, 256, "fp16")):
        msg = _error_of(lambda: torch_encode(x, codec, device))
        assert "element 200013 is " + str(bad) in msg
        assert msg == _error_of(lambda: numpy_encode(x, codec))
    x[200_013] = x[250_000] = 1.0  # only the fp16 overflow left: named by its block
    msg = _error_of(lambda: torch_encode(x, Codec(8, 256, "fp16"), device))
    assert msg == _error_of(lambda: numpy_encode(x, Codec(8, 256, "fp16"))) and "block 1132: absmax 1e+09" in msg
    edge = torch.full((4,), 127 * 65510.0)  # rounds down to 65504, then up past it
    assert "use scale_dtype fp32" in _error_of(lambda: torch_encode(edge, Codec(8, 256, "fp16"), device))


@pytest.mark.parametrize("device", DEVICES)
def test_marking_gives_the_same_bytes_and_message_as_numpy(device):
    """What a collective does: bad blocks get a NaN scale and zero codes, the message is returned."""
    for codec in (Codec(8, 100), Codec(4, 100, "fp16")):
        x = torch.randn(1003)
        x[613], x[950] = float("inf"), float("nan")
        want, (want_scale, want_msg) = numpy_encode(x, codec, mark=True)
        got, (got_scale, got_msg) = torch_encode(x, codec, device, mark=True)
        assert np.array_equal(got.cpu().numpy(), want) and got_scale == want_scale
        assert got_msg == want_msg and "element 613 is inf" in got_msg
        assert torch_codec.marked(codec, got, 1003) and codec.marked(want, 1003)
        assert not torch_codec.marked(codec, torch_encode(x.nan_to_num(0, 0, 0), codec, device)[0], 1003)


@pytest.mark.parametrize("device", DEVICES)
def test_a_block_at_float32s_largest_value_is_marked_not_decoded_to_inf(device):
    """int8 rounds the scale up, so 127 x scale of a block whose absmax is float32's largest
    value overflowed to inf on decode, and encode said nothing. Both codecs mark it alike."""
    x = torch.tensor([float(np.finfo(np.float32).max), 1.0, -3.0, 0.5])
    want, (_, want_msg) = numpy_encode(x, Codec(8, 2), mark=True)
    got, (_, got_msg) = torch_encode(x, Codec(8, 2), device, mark=True)
    assert want_msg and want_msg == got_msg and "block 0" in want_msg and "rescale the tensor" in want_msg
    assert np.array_equal(got.cpu().numpy(), want) and Codec(8, 2).marked(want, 4)
    decoded = Codec(8, 2).decode(want, 4)
    assert np.isnan(decoded[:2]).all() and np.allclose(decoded[2:], [-3.0, 0.5], atol=3 / 127)  # within s/2
    fine = torch.tensor([3.3e38, 1.0])  # 127 x its scale stays finite: encoded as before
    assert numpy_encode(fine, Codec(8, 2), mark=True)[1][1] is None


def test_wrong_sizes_and_dtypes_are_refused():
    codec = Codec(8)
    with pytest.raises(ValueError, match="out has 3 bytes, a chunk of 10 needs 16"):
        torch_codec.encode_into(codec, torch.empty(3, dtype=torch.uint8), torch.ones(10))
    with pytest.raises(ValueError, match="chunk has 3 bytes, 10 values need 16"):
        torch_codec.decode(codec, torch.empty(3, dtype=torch.uint8), 10)
    with pytest.raises(TypeError, match="take float tensors; got torch.int32"):
        torch_codec.encode_into(codec, torch.empty(16, dtype=torch.uint8), torch.ones(10, dtype=torch.int32))


def test_non_contiguous_input_encodes_its_values():
    x = torch.randn(40, 50).t()[:, ::3]
    assert_identical(x.contiguous(), Codec(4, 6), "cpu")
    got, _ = torch_encode(x, Codec(4, 6), "cpu")
    assert np.array_equal(got.numpy(), numpy_encode(x.contiguous(), Codec(4, 6))[0])


@pytest.mark.parametrize("device", DEVICES)
def test_ties_round_half_to_even(device):
    """absmax 127 gives a scale of exactly 1: x.5 values are ties, rounded to the even code."""
    x = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5])
    buf, _ = torch_encode(x, Codec(8), device)
    codes = buf.cpu().numpy()[4:12].view(np.int8)
    assert codes.tolist() == [127, 0, 2, 2, 0, -2, -2, 126]
    assert_identical(x, Codec(8), device)
