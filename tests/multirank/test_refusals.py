"""A local refusal on one rank reaches its peers (programs/refusals.py)."""
import pytest

from tests.multirank.harness import run_ranks


@pytest.mark.parametrize("intra", ["tcp", "shm"])
@pytest.mark.parametrize("case,nproc", [("readonly_output", 3), ("dtypes_differ", 3), ("broadcast_leaf", 2),
                                        ("async_reduce_scatter", 3), ("unknown_root", 3)])
def test_one_ranks_refusal_fails_its_peers_at_once_naming_it(case, nproc, intra, tmp_path):
    """Before, the peers waited in the op until the deadline (60 s here; the launch's bound is
    50 s) and then blamed rank 1 as lost, without saying why."""
    _, out = run_ranks(nproc, "refusals", case, str(tmp_path), timeout_s=50,
                       env={"COMMRT_COMM_BACKEND": "zmq", "COMMRT_COMM_INTRA_NODE": intra,
                            "COMMRT_COMM_TIMEOUT_S": "60"})
    assert out.count(f"refusals {case} ok") == nproc
