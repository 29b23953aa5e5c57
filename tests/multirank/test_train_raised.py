"""A forward or a backward that raised on every rank (caught by the loop), then training on, at
2 ranks against single-process torch (the checks live in programs/train_raised.py and print
'OK <what>')."""
from tests.multirank.harness import run_ranks


def test_stage3_lets_go_of_a_forward_that_raised():
    """The units a raising forward gathered are released and its prefetches waited out; the
    steps after it equal torch's without the failed forward."""
    _, out = run_ranks(2, "train_raised", "forward_raised", env={"COMMRT_COMM_BACKEND": "zmq"}, timeout_s=120)
    for at in (0, 1):
        assert out.count(f"OK stage 3 after a forward that raised at {at}\n") == 2, out[-3000:]
