"""``commrt bench p2p``'s check (bench/p2p.py): both directions of the checked round trip are
compared with what rank 0 sent. Pure: one rank of two, played by a fake backend."""
import torch

from commrt.bench import p2p


class _Done:
    def wait(self):
        return None


class _NoReturnPath:
    """Rank ``rank`` of 2: what it sends goes nowhere, and nothing ever arrives."""

    name, size = "zmq", 2

    def __init__(self, rank: int):
        self.rank = rank

    def barrier(self, async_op=False):
        return None

    def all_reduce(self, t, op, async_op=False):  # the #wrong sum: this rank's own
        return None

    def isend(self, t, dst, tag):
        return _Done()

    def irecv(self, t, src, tag):
        return _Done()


def test_rank_0_checks_the_bytes_that_came_back():
    # rank 0 sent from and received into one buffer that already held the expected bytes:
    # with nothing coming back it counted 0 wrong (the echo direction was never checked)
    row = p2p.measure(_NoReturnPath(0), 0, 64, iters=1, warmup=0)
    assert row["wrong"] == 16


def test_rank_1_checks_the_bytes_that_arrived():
    assert p2p.measure(_NoReturnPath(1), 1, 64, iters=1, warmup=0)["wrong"] == 16
