"""A peer freezes (SIGSTOP) in a broadcast: every survivor names it through liveness, whether it
waits in a receive or in a send the frozen peer never drains, and a rank that finished and left
meanwhile is not blamed. The op timeout (30 s) is far above the heartbeat bound (0.3 s beats);
the victim wakes and exits after 4 s, so a survivor that caught it in under 30 s found it
through the dropped connection, not the deadline."""
import re

import pytest

from tests.multirank.harness import alive, run_ranks

TIMEOUT_S = 30.0
ENV = {"COMMRT_COMM_BACKEND": "zmq", "COMMRT_COMM_INTRA_NODE": "tcp", "COMMRT_COMM_TIMEOUT_S": str(TIMEOUT_S),
       "COMMRT_COMM_HEARTBEAT_S": "0.3"}


def caught(nproc: int, shape: str) -> tuple[list, str]:
    env = {**ENV, "COMMRT_COMM_ALGORITHMS": f"broadcast={shape}"}
    result, out = run_ranks(nproc, "frozen_peer", shape, env=env, timeout_s=60, stop_on_failure=False)
    assert not [pid for pid in result.pids if alive(pid)], "processes left running"
    return re.findall(r"\[rank (\d+)\] CAUGHT PeerLost: (.*) \(rank attribute (\d+), after ([\d.]+)s\)", out), out


@pytest.mark.slow  # ~6 s; the test below runs a frozen rank by default (CI's 15 minutes)
def test_a_sender_blocked_on_a_frozen_peer_names_it():
    """Chain from rank 0 at 3 ranks, 64 MiB: rank 0 waits for its send to rank 1 to drain (it
    waited out the whole op timeout, "send not drained before the deadline", while rank 2
    named rank 1 within 1.6 s)."""
    found, out = caught(3, "chain")
    assert sorted(r for r, *_ in found) == ["0", "2"], out
    for _, message, rank, seconds in found:
        assert rank == "1" and message.startswith("lost peer rank 1 during broadcast (seq 4)"), out
        assert "deadline" not in message and float(seconds) < TIMEOUT_S, out



def test_a_rank_that_finished_is_not_blamed():
    """Binomial from rank 2 at 5 ranks: rank 0 waits on the frozen rank 4 while ranks 1 and 3,
    served by the root, finish and leave (destroying the group); rank 0 must name rank 4 (it
    named a rank that left, whose connection dropped first: "lost peer rank 3 ...; rank 4,
    which this rank was waiting on, dropped after it")."""
    found, out = caught(5, "binomial")
    assert [(r, rank) for r, _, rank, _ in found] == [("0", "4")], out
    assert found[0][1].startswith("lost peer rank 4 during broadcast (seq 4)"), out
    assert "dropped after it" not in found[0][1], out
