"""API misuse on real ranks: destroyed group handles and tensors that require grad (issue 13.19)."""
import pytest

from tests.multirank.harness import run_ranks


@pytest.mark.parametrize("backend", ["zmq", "gloo"])
@pytest.mark.parametrize("mode", ["destroyed", "grad"])
def test_misuse(backend, mode):
    _, out = run_ranks(2, "misuse", mode, env={"COMMRT_COMM_BACKEND": backend}, timeout_s=90)
    assert out.count(f"misuse {mode} ok") == 2
