import pytest

from .harness import run_ranks


@pytest.mark.parametrize("backend", ["zmq", "gloo"])
def test_standard_calls_take_quant(backend):
    _, out = run_ranks(3, "quant_api", env={"COMMRT_COMM_BACKEND": backend})
    assert out.count("quant api passed") == 3, out
