"""CUDA paths (marked ``cuda``: skipped without a GPU) and the backend choice and fallback (these
run everywhere: the NCCL failure is simulated)."""
import logging

import pytest
import torch

from commrt.runtime import bootstrap, rendezvous
from commrt.runtime.config import load_config
from commrt.runtime.errors import CommError
from commrt.launch import free_port
from tests.multirank.harness import run_ranks

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.cuda
@needs_cuda
def test_nccl_world_size_one():
    _, out = run_ranks(1, "cuda_job", "nccl", timeout_s=120)
    assert out.count("OK ") == 6, out


@pytest.mark.cuda
@needs_cuda
def test_cuda_tensors_over_zmq_two_ranks_sharing_a_gpu():
    _, out = run_ranks(2, "cuda_job", "zmq", timeout_s=120, env={"CUDA_VISIBLE_DEVICES": "0"})
    assert out.count("OK ") == 2 * 6 + 1, out


@pytest.mark.cuda
@needs_cuda
def test_auto_picks_nccl_with_a_gpu_per_rank():
    name, why = bootstrap.choose_backend("auto", 1)
    assert name == "nccl", why


@pytest.mark.parametrize("gpus,local,nccl,expect", [
    (0, 1, True, "zmq"), (1, 2, True, "zmq"), (2, 2, True, "nccl"), (2, 2, False, "zmq")])
def test_auto_choice(monkeypatch, gpus, local, nccl, expect):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: nccl)
    name, why = bootstrap.choose_backend("auto", local)
    assert name == expect and why, why
    assert bootstrap.choose_backend("gloo", local)[0] == "gloo"


def _simulate_broken_nccl(monkeypatch):
    real = bootstrap._init_torch

    def broken(name, *args):
        if name == "nccl":
            raise RuntimeError("simulated NCCL failure: ncclUnhandledCudaError")
        return real(name, *args)
    monkeypatch.setattr(bootstrap, "choose_backend", lambda requested, local: ("nccl", "simulated GPU box"))
    monkeypatch.setattr(bootstrap, "_init_torch", broken)


@pytest.mark.parametrize("requested", ["auto", "nccl"])
def test_nccl_failure_falls_back_only_under_auto(monkeypatch, caplog, requested):
    _simulate_broken_nccl(monkeypatch)
    cfg = load_config(overrides={"comm": {"backend": requested, "timeout_s": 10}}, environ={})
    spec = rendezvous.resolve(f"tcp://127.0.0.1:{free_port()}", 0, 1, environ={})
    if requested == "nccl":
        with pytest.raises(CommError, match="nccl' was requested but NCCL initialisation failed.*simulated"):
            bootstrap.init_world(cfg, spec, environ={})
        return
    with caplog.at_level(logging.WARNING, logger="commrt.runtime.bootstrap"):
        rt = bootstrap.init_world(cfg, spec, environ={})
    try:
        assert rt.world.backend.name == "zmq"
        assert "falling back to zmq" in caplog.text and "simulated NCCL failure" in caplog.text
        t = torch.ones(5)
        rt.world.backend.all_reduce(t)
        assert torch.equal(t, torch.ones(5))
    finally:
        bootstrap.shutdown(rt)
