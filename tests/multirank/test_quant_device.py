"""The quantized collectives' device path (the torch codec) against the numpy path, bit for bit,
with ranks of both kinds in one collective: on CPU tensors here, on CUDA tensors where a GPU is."""
import pytest
import torch

from tests.multirank.harness import run_ranks


@pytest.mark.parametrize("world_size", [2, 3])
def test_torch_codec_path_matches_numpy_path_bit_for_bit(world_size):
    _, out = run_ranks(world_size, "quant_device", "cpu", env={"COMMRT_COMM_BACKEND": "zmq"}, timeout_s=240)
    assert out.count("quant device path identical") == world_size, out


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_tensors_quantized_on_the_device_match_cpu_ranks():
    _, out = run_ranks(2, "quant_device", "cuda", env={"COMMRT_COMM_BACKEND": "zmq", "CUDA_VISIBLE_DEVICES": "0"},
                       timeout_s=240)
    assert out.count("quant device path identical") == 2, out
