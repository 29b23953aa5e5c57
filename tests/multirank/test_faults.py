"""Fault injection: a rank dies or freezes mid-collective; survivors name it within the bound,
and no process is left behind. Settings as the issue asks: op timeout 1 s, heartbeat 0.2 s.
(A silent peer is given 4 heartbeats past the op timeout to be recognised as frozen.)"""
import os
import re

import pytest

from tests.multirank.harness import run_ranks

TIMEOUT_S, HEARTBEAT_S = 1.0, 0.2
ENV = {"COMMRT_COMM_BACKEND": "zmq", "COMMRT_COMM_TIMEOUT_S": str(TIMEOUT_S),
       "COMMRT_COMM_HEARTBEAT_S": str(HEARTBEAT_S)}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("mode", ["exit0", "exit1", "abort", "sigkill", "sigterm", "sigstop"])
@pytest.mark.parametrize("nproc", [2, 3])
def test_survivors_name_the_lost_rank(mode, nproc):
    result, out = run_ranks(nproc, "faults", mode, env=ENV, timeout_s=40, stop_on_failure=False,
                            expect_fail=mode not in ("exit0", "sigstop"))
    caught = re.findall(r"CAUGHT PeerLost: (.*) \(detected after ([\d.]+)s\)", out)
    assert len(caught) == nproc - 1, out
    for message, seconds in caught:
        assert "lost peer rank 1 during all_reduce (seq 3)" in message, out
        assert float(seconds) < TIMEOUT_S + 2, out
    assert not [pid for pid in result.pids if _alive(pid)], "processes left running"
