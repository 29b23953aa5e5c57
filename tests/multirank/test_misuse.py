"""API misuse on real ranks: destroyed group handles and tensors that require grad (issue 13.19),
ranks disagreeing about the reduce op or root (13.5), tags the wire cannot carry (13.6)."""
import pytest

from tests.multirank.harness import run_ranks


@pytest.mark.parametrize("backend", ["zmq", "gloo"])
@pytest.mark.parametrize("mode", ["destroyed", "grad", "tags"])
def test_misuse(backend, mode):
    _, out = run_ranks(2, "misuse", mode, env={"COMMRT_COMM_BACKEND": backend}, timeout_s=90)
    assert out.count(f"misuse {mode} ok") == 2


@pytest.mark.parametrize("case", ["max_vs_sum", "avg_vs_sum_ring", "reduce_scatter_min", "reduce_max",
                                  "broadcast_roots", "reduce_roots"])
def test_reduce_op_and_root_mismatch_is_named(case):
    """Our backend checks op and root in every header (gloo checks nothing: not run there).
    On TCP, where a sender-only rank cannot see it; shared memory (every rank reads every
    header) is covered in test_shm.py."""
    _, out = run_ranks(2, "misuse", "mismatch", case, env={"COMMRT_COMM_BACKEND": "zmq",
                                                            "COMMRT_COMM_INTRA_NODE": "tcp"}, timeout_s=90)
    assert out.count("misuse mismatch ok") == 2
