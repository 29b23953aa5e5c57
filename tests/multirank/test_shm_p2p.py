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
    # rank 1's ring held the large message; rank 0's small reply may have gone through its
    # mailbox to rank 1 (in the same segment) if rank 1 was already waiting for it
    assert 1 <= len(rings) <= 2 and not _left_in_dev_shm(out), out[-3000:]


def test_small_messages_take_the_mailbox_in_order_with_the_socket_and_the_ring():
    """Waiting receivers get small messages through their mailbox, late ones over the socket,
    large ones as ring descriptors, all in sending order per tag (transport/mailbox.py)."""
    env = {"COMMRT_COMM_BACKEND": "zmq", "COMMRT_COMM_INTRA_NODE": "shm"}
    _, out = run_ranks(2, "shm_p2p", "mixed", env=env, timeout_s=240)
    assert out.count("p2p mixed passed") == 2, out[-3000:]
    counts = [tuple(map(int, m)) for m in re.findall(r"mailed (\d+), socket (\d+)", out)]
    assert len(counts) == 2 and all(mailed > 0 for mailed, _ in counts), counts
    assert any(sock > 0 for _, sock in counts), counts  # the socket path was taken too
    assert not _left_in_dev_shm(out)


def test_a_destroyed_group_leaves_no_ring_open_or_mapped():
    """Whether or not a group's point-to-point engine ever ran, destroying it closes its rings."""
    env = {"COMMRT_COMM_BACKEND": "zmq", "COMMRT_COMM_INTRA_NODE": "shm"}
    _, out = run_ranks(2, "shm_p2p", "groups", env=env, timeout_s=120)
    assert out.count("p2p groups passed") == 2, out[-3000:]
