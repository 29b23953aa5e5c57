"""Edge cases of DataParallel and the ZeRO engine at 2 ranks against single-process torch (the
checks live in programs/train_edges.py, one case per run, and print 'OK <what>')."""
from tests.multirank.harness import run_ranks


def _run(case: str) -> str:
    _, out = run_ranks(2, "train_edges", case, env={"COMMRT_COMM_BACKEND": "zmq"}, timeout_s=120)
    return out


def test_data_parallel_reduces_a_parameter_used_only_under_no_sync():
    out = _run("ddp_no_sync")
    assert out.count("OK DataParallel parameter used only under no_sync\n") == 2, out[-3000:]


def test_two_backwards_before_one_step_add_up_at_every_stage():
    out = _run("two_backwards")
    for what in ("stage 0", "stage 1", "stage 2", "stage 3", "stage 0 bf16", "stage 1 bf16"):
        assert out.count(f"OK {what} two backwards, one step\n") == 2, out[-3000:]
