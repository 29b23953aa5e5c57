"""Point-to-point failures in a subgroup on real ranks, over TCP and shared memory: the error
names the global ranks (the group's collectives do too), a lost or frozen sender is found
through liveness, not the op timeout, and a mismatched receive loses no later message."""
import re

import pytest

from tests.multirank.harness import run_ranks

pytestmark = pytest.mark.timeout(300)

TIMEOUT_S = 30.0
ENV = {"COMMRT_COMM_BACKEND": "zmq", "COMMRT_COMM_TIMEOUT_S": str(TIMEOUT_S), "COMMRT_COMM_HEARTBEAT_S": "0.3",
       "COMMRT_COMM_CHUNK_BYTES": str(64 << 10)}


# CI time: by default each check on one path (the naming and the matching are the same on both)
@pytest.mark.parametrize("intra", [pytest.param("tcp", marks=pytest.mark.slow), "shm"])
def test_a_mismatched_receive_names_global_ranks_and_loses_nothing_after_it(intra):
    _, out = run_ranks(3, "p2p_faults", "mismatch", env={**ENV, "COMMRT_COMM_INTRA_NODE": intra}, timeout_s=120)
    caught = re.findall(r"CAUGHT CollectiveMismatch: (.*) \(rank (\d+), peer (\d+)\)", out)
    assert len(caught) == 1, out[-3000:]
    message, rank, peer = caught[0]
    assert (rank, peer) == ("2", "1") and "rank 2 runs" in message and "rank 1 runs" in message, out[-3000:]
    assert "the next messages arrived intact" in out, out[-3000:]


def _caught_once(mode: str, intra: str, expect_fail: bool) -> tuple[tuple[str, str, str], str]:
    """(message, rank, seconds) of the one PeerLost the 3-rank program caught, and its output."""
    _, out = run_ranks(3, "p2p_faults", mode, env={**ENV, "COMMRT_COMM_INTRA_NODE": intra}, timeout_s=120,
                       stop_on_failure=False, expect_fail=expect_fail)
    caught = re.findall(r"CAUGHT PeerLost: (.*) \(rank (\d+), after ([\d.]+)s\)", out)
    assert len(caught) == 1, out[-3000:]
    return caught[0], out


# a freeze holds the run for its 6 s (the launcher waits for the frozen rank): under -m slow
@pytest.mark.parametrize("mode,intra", [("sigkill", "tcp"), pytest.param("sigkill", "shm", marks=pytest.mark.slow),
                                        *(pytest.param("sigstop", i, marks=pytest.mark.slow) for i in ("shm", "tcp"))])
def test_a_lost_sender_is_named_by_its_global_rank(mode, intra):
    (message, rank, seconds), out = _caught_once(mode, intra, expect_fail=mode == "sigkill")
    assert rank == "1" and message.startswith("lost peer rank 1 during recv"), out[-3000:]
    assert "[rank 0 of group" in message, out[-3000:]
    assert float(seconds) < TIMEOUT_S, out[-3000:]  # liveness, not the op timeout


@pytest.mark.parametrize("mode,intra", [pytest.param("sendlost", "tcp", marks=pytest.mark.slow), ("sendlost", "shm"),
                                        *(pytest.param("sendstop", i, marks=pytest.mark.slow) for i in ("shm", "tcp"))])
def test_sends_to_a_lost_rank_fail_naming_it(mode, intra):
    """Sends to a dead or frozen rank (what ZeroMQ or the ring cannot take waits) fail through
    liveness, as receives do, not after the op timeout."""
    (message, rank, seconds), out = _caught_once(mode, intra, expect_fail=mode == "sendlost")
    assert rank == "2" and message.startswith("lost peer rank 2 during send"), out[-3000:]
    assert "[rank 1 of group" in message, out[-3000:]
    assert float(seconds) < TIMEOUT_S, out[-3000:]  # liveness, not the op timeout
