"""CUDA paths (marked ``cuda``: skipped without a GPU) and the backend choice and fallback (these
run everywhere: the NCCL failure is simulated)."""
import logging
import threading
import time

import pytest
import torch

from commrt.runtime import bootstrap, rendezvous, torch_init
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
    assert out.count("OK ") == 2 * 7 + 1, out  # 7 checks per rank (int8 avg among them), send/recv once


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

    def broken(name, *args, **kw):
        if name == "nccl":
            raise RuntimeError("simulated NCCL failure: ncclUnhandledCudaError")
        return real(name, *args, **kw)
    monkeypatch.setattr(bootstrap, "choose_backend", lambda requested, local: ("nccl", "simulated GPU box"))
    monkeypatch.setattr(bootstrap.devices, "describe", lambda local: {"device": f"cuda:{local}", "uuid": str(local)})
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


def _init_two_ranks(backend: str, timeout_s: float = 60) -> tuple[dict, float]:
    """init_world on ranks 0 and 1 (threads of this process): what each raised, and how long."""
    cfg = load_config(overrides={"comm": {"backend": backend, "timeout_s": timeout_s}}, environ={})
    port, errors = free_port(), {}

    def rank(r):
        spec = rendezvous.resolve(f"tcp://127.0.0.1:{port}", r, 2, environ={})
        try:
            bootstrap.shutdown(bootstrap.init_world(cfg, spec, environ={"LOCAL_RANK": str(r)}))
        except Exception as exc:  # noqa: BLE001 -- the test inspects it
            errors[r] = exc
    start = time.monotonic()
    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 30)
    return errors, time.monotonic() - start


def test_explicit_nccl_without_a_gpu_fails_at_once_on_every_rank_with_its_cause(monkeypatch):
    """issue 31 item 1: was a ZeroDivisionError on rank 0 and a 300 s wait on rank 1."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    errors, took = _init_two_ranks("nccl")
    assert sorted(errors) == [0, 1] and took < 20, (errors, took)
    for r, exc in errors.items():
        assert isinstance(exc, CommError), exc
        assert "nccl' was requested" in str(exc) and "rank 0: CUDA is not available" in str(exc), exc


def test_two_ranks_on_one_gpu_under_nccl_fail_at_init_naming_ranks_device_and_fix(monkeypatch):
    """issue 30 item 9: was NCCL's raw "Duplicate GPU detected" at the first collective."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: type("P", (), {"uuid": "GPU-0"})())
    errors, took = _init_two_ranks("nccl")
    assert sorted(errors) == [0, 1] and took < 20, (errors, took)
    for exc in errors.values():
        assert isinstance(exc, CommError) and "ranks 0, 1 share GPU cuda:0" in str(exc), exc
        assert 'backend = "auto"' in str(exc) and "one rank per GPU" in str(exc), exc


def test_auto_asks_torch_for_gloo_beside_nccl_so_cpu_tensors_work():
    """issue 30 item 8: NCCL alone refused a CPU model's tensors on a GPU machine."""
    assert torch_init.torch_backend_string("nccl", "auto") == "cpu:gloo,cuda:nccl"
    assert torch_init.torch_backend_string("nccl", "nccl") == "nccl"
    assert torch_init.torch_backend_string("gloo", "gloo") == "gloo"
