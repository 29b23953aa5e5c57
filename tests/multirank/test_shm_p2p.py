"""Point-to-point payloads between ranks of one node through shared-memory rings
(transport/shm_p2p.py), each transfer against what was sent, on both paths; a dead sender is a
PeerLost naming it, and no ring ever has a name in /dev/shm."""
import os
import re

import pytest

from tests.multirank.harness import run_ranks

pytestmark = pytest.mark.timeout(300)


def _rings(out: str) -> set[str]:
    return set(re.findall(r"ring: (ring-[0-9a-f]+)", out))


def _left_in_dev_shm(out: str) -> list[str]:
    pids = set(re.findall(r"pid: ([0-9]+)", out))
    assert pids, out[-3000:]
    return [n for n in os.listdir("/dev/shm") if n.startswith("commrt-") and n.split("-")[1] in pids]


@pytest.mark.parametrize("nproc,path", [(3, "shm"), (2, "tcp"), pytest.param(4, "shm", marks=pytest.mark.slow)])
def test_transfers_arrive_intact_on_either_path(nproc, path):
    env = {"COMMRT_COMM_BACKEND": "zmq", "COMMRT_COMM_INTRA_NODE": path}
    _, out = run_ranks(nproc, "shm_p2p", "data", env=env, timeout_s=240)
    assert out.count("p2p data passed") == nproc, out[-3000:]
    assert out.count(f"rings used {path == 'shm'}") == nproc, out[-3000:]
    rings = _rings(out)
    assert len(rings) == (2 * (nproc - 1) if path == "shm" else 0), rings  # rank 0 to each peer, each back
    assert not _left_in_dev_shm(out)


def test_a_killed_sender_is_a_peer_lost_naming_it_and_leaves_no_ring():
    env = {"COMMRT_COMM_BACKEND": "zmq", "COMMRT_COMM_INTRA_NODE": "shm", "COMMRT_COMM_TIMEOUT_S": "20"}
    _, out = run_ranks(2, "shm_p2p", "kill", env=env, timeout_s=120, stop_on_failure=False, expect_fail=True)
    assert re.search(r"CAUGHT PeerLost: lost peer rank 1 during recv", out), out[-3000:]
    rings = _rings(out)
    assert len(rings) == 1 and not _left_in_dev_shm(out), out[-3000:]
