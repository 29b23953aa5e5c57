"""Issue 13.4: destroy_process_group() then init_process_group() again, in the same processes
on the same MASTER_PORT, works whichever side re-initialises first."""
import pytest

from tests.multirank.harness import run_ranks


@pytest.mark.parametrize("order", ["together", "rank0_first", "others_first"])
@pytest.mark.parametrize("backend", ["zmq", "gloo"])
def test_reinit_on_the_same_port(tmp_path, order, backend):
    _, out = run_ranks(3, "reinit", str(tmp_path), order, env={"COMMRT_COMM_BACKEND": backend},
                       timeout_s=120)
    assert out.count(f"reinit {order} passed") == 3, out
