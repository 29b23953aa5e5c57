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
                                  "avg_int8_vs_int64", "bool_vs_uint8",
                                  "broadcast_roots", "reduce_roots", "all_to_all_lengths",
                                  "all_to_all_more_pieces"])
def test_reduce_op_and_root_mismatch_is_named(case):
    """Our backend checks op and root in every header (gloo checks nothing: not run there).
    On TCP, where a sender-only rank cannot see it; shared memory (every rank reads every
    header) is covered in test_shm.py."""
    _, out = run_ranks(2, "misuse", "mismatch", case, env={"COMMRT_COMM_BACKEND": "zmq",
                                                            "COMMRT_COMM_INTRA_NODE": "tcp"}, timeout_s=90)
    assert out.count("misuse mismatch ok") == 2


def test_all_to_all_block_lengths_that_disagree_are_named_on_shared_memory():
    """Rank 1 sends rank 0 fewer elements than rank 0 expects: every rank names both (shared
    memory used to read a stale element; TCP sees the piece's size)."""
    _, out = run_ranks(2, "misuse", "mismatch", "all_to_all_lengths",
                       env={"COMMRT_COMM_BACKEND": "zmq", "COMMRT_COMM_INTRA_NODE": "shm"}, timeout_s=90)
    assert out.count("misuse mismatch ok") == 2


def test_an_empty_op_against_a_full_one_is_named_not_waited_out():
    """One rank with no elements (3 ranks over TCP, where the hang needs a third rank): every
    rank names the counts at once; it used to skip the op and leave the others to the deadline,
    which then blamed a live rank as lost (the harness's deadline here is 30 s)."""
    _, out = run_ranks(3, "misuse", "mismatch", "empty_reduce",
                       env={"COMMRT_COMM_BACKEND": "zmq", "COMMRT_COMM_INTRA_NODE": "tcp"}, timeout_s=90)
    assert out.count("misuse mismatch ok") == 3
