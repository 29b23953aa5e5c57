"""Edge cases of DataParallel and the ZeRO engine at 2 ranks against single-process torch (the
checks live in programs/train_edges.py, one case per run, and print 'OK <what>')."""
from tests.multirank.harness import run_ranks


def _run(case: str) -> str:
    _, out = run_ranks(2, "train_edges", case, env={"COMMRT_COMM_BACKEND": "zmq"}, timeout_s=120)
    return out


def test_data_parallel_reduces_a_parameter_used_only_under_no_sync():
    out = _run("ddp_no_sync")
    assert out.count("OK DataParallel parameter used only under no_sync\n") == 2, out[-3000:]
