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


def test_one_rank_under_a_launcher_is_refused_before_it_starts(monkeypatch, capsys):
    """Under a launcher of one rank (torchrun -n 1, commrt launch -n 1) the bench started a world
    of one, then rank 0's send to rank 1 was a ValueError traceback."""
    from commrt.cli import main
    from commrt.launch import free_port
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    assert main(["bench", "p2p", "-b", "4K", "-e", "4K", "-n", "1", "-w", "0"]) == 1
    assert "start it with 2 ranks or more (WORLD_SIZE=1)" in capsys.readouterr().err


def test_options_p2p_does_not_read_are_refused_not_ignored():
    """bench p2p sends float32 and draws nothing: --plot, -d float16 or --algo were ignored
    without a word (no plot, float32 timed under a float16 request)."""
    import pytest

    from commrt.cli import main
    with pytest.raises(SystemExit, match=r"--datatype, --plot do not apply to p2p"):
        main(["bench", "p2p", "-d", "float16", "--plot", "x.png", "-n", "1"])
