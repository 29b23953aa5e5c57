"""Edge cases of DataParallel and the ZeRO engine at 2 ranks against single-process torch (the
checks live in programs/train_edges.py and print 'OK <what>'; every case runs in one launch, as
each rank's torch import costs more than the cases, and each test checks its own lines)."""
import pytest

from tests.multirank.harness import run_ranks

pytestmark = pytest.mark.xdist_group("train_edges")  # one worker runs these tests: the launch runs once


@pytest.fixture(scope="module")
def out():
    """The raising cases last: the cases before them ran on a group nothing had failed on."""
    _, text = run_ranks(2, "train_edges", "ddp_no_sync,two_backwards,closed,ddp_dropped,ddp_backward_raised,"
                        "ddp_raised_zeroed_in_place", env={"COMMRT_COMM_BACKEND": "zmq"}, timeout_s=200)
    return text


def test_no_sync_usage_and_two_backwards_before_one_step_match_torch(out):
    """DataParallel reduces a parameter used only under no_sync at the synchronised backward;
    two backward() calls before one step() add up at every ZeRO stage, as in torch."""
    assert out.count("OK DataParallel parameter used only under no_sync\n") == 2, out[-3000:]
    for what in ("stage 0", "stage 1", "stage 2", "stage 3", "stage 0 bf16", "stage 1 bf16"):
        assert out.count(f"OK {what} two backwards, one step\n") == 2, out[-3000:]


def test_a_closed_engine_leaves_a_plain_torch_module(out):
    """close() removes the engine's hooks and, at stage 3, leaves the trained values in the
    parameters: a plain torch loop afterwards trains as on a fresh copy of those values."""
    for stage in (0, 1, 2, 3):
        for what in ("parameters", "plain torch after"):
            assert out.count(f"OK stage {stage} closed: {what}\n") == 2, out[-3000:]


def test_data_parallel_averages_again_after_a_backward_that_raised(out):
    """A backward that raised (on every rank, caught by the loop) after its first bucket's
    all-reduce started: the next steps are averaged as torch's, not left per replica."""
    assert out.count("OK DataParallel after a backward that raised\n") == 2, out[-3000:]


def test_data_parallel_a_raised_backwards_late_all_reduce_stays_out_of_gradients_zeroed_in_place(out):
    """An all-reduce of the backward that raised ended after the caller's zero_grad(set_to_none=
    False) (the peer was late) and wrote into the gradients it viewed: the next step added it."""
    assert out.count("OK DataParallel after a backward that raised, gradients zeroed in place\n") == 2, out[-3000:]


def test_a_data_parallel_let_go_of_leaves_the_module_its_own_gradients(out):
    assert out.count("OK DataParallel let go of: the bare module's gradients are its own\n") == 2, out[-3000:]
