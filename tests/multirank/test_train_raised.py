"""A forward or a backward that raised on every rank (caught by the loop), then training on, at
2 ranks against single-process torch (the checks live in programs/train_raised.py and print
'OK <what>')."""
import pytest

from tests.multirank.harness import run_ranks

AT_TWO = pytest.mark.xdist_group("train_raised_at_two")  # one worker runs both tests below: the launch runs once


@pytest.fixture(scope="module")
def at_two():
    """One launch of 2 ranks for both cases below (each launch imports torch on every rank)."""
    _, out = run_ranks(2, "train_raised", "forward_raised,zero_grad", env={"COMMRT_COMM_BACKEND": "zmq"},
                       timeout_s=180)
    return out


@AT_TWO
def test_stage3_lets_go_of_a_forward_that_raised(at_two):
    """The units a raising forward gathered are released and its prefetches waited out; the
    steps after it equal torch's without the failed forward."""
    out = at_two
    for at in (0, 1):
        assert out.count(f"OK stage 3 after a forward that raised at {at}\n") == 2, out[-3000:]


@AT_TWO
def test_zero_grad_drops_a_backward_that_raised_at_every_stage(at_two):
    """A backward that raised halfway on every rank, then engine.zero_grad(): the run equals one
    that skipped that step (torch in fp32, the engine's own bit for bit in bf16), at stages 0-3
    and MiCS (hybrid stage 3, whose step overlaps the next forward)."""
    out = at_two
    for what in ("stage 0", "stage 1", "stage 2", "stage 3", "stage 1 bf16", "stage 2 bf16", "stage 3 bf16",
                 "MiCS /1 bf16"):
        assert out.count(f"OK {what}: zero_grad after a backward that raised\n") == 2, out[-3000:]


@pytest.mark.slow  # 40 s at 4 ranks on 2 cores
def test_zero_grad_drops_a_backward_that_raised_with_hybrid_sharding_hpz_and_zeropp():
    _, out = run_ranks(4, "train_raised", "zero_grad_hybrid", env={"COMMRT_COMM_BACKEND": "zmq"}, timeout_s=300)
    for what in ("HYBRID_SHARD", "HYBRID_SHARD bf16", "_HYBRID_SHARD_ZERO2", "hpZ", "qwZ+qgZ stream bf16"):
        assert out.count(f"OK {what}: zero_grad after a backward that raised\n") == 4, out[-3000:]
