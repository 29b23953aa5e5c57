"""Receives from any source, on our transport (TCP and shared-memory rings) and on gloo through
the same API: every sender's messages arrive whole, once each and in its order; a receive from
any source that nobody answers ends by the deadline as a PeerLost."""
import re

import pytest

from tests.multirank.harness import run_ranks

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("nproc,backend,path", [(3, "zmq", "shm"), (3, "zmq", "tcp"), (3, "gloo", "tcp"),
                                                pytest.param(4, "zmq", "shm", marks=pytest.mark.slow)])
def test_every_senders_messages_arrive_once_in_order(nproc, backend, path):
    env = {"COMMRT_COMM_BACKEND": backend, "COMMRT_COMM_INTRA_NODE": path}
    _, out = run_ranks(nproc, "anysource", "match", env=env, timeout_s=240)
    assert "anysource match passed" in out, out[-3000:]


def test_a_receive_nobody_answers_is_a_peer_lost_by_the_deadline():
    env = {"COMMRT_COMM_BACKEND": "zmq", "COMMRT_COMM_TIMEOUT_S": "3"}
    _, out = run_ranks(2, "anysource", "silent", env=env, timeout_s=120)
    found = re.search(r"CAUGHT PeerLost after ([0-9.]+)s: lost any peer during recv .*tag 99", out)
    assert found and float(found.group(1)) < 30, out[-3000:]


def test_a_dead_possible_sender_ends_a_receive_from_any_source_naming_it():
    """issue 30 item 11: it waited out the whole timeout (60 s here) without naming the rank."""
    env = {"COMMRT_COMM_BACKEND": "zmq", "COMMRT_COMM_TIMEOUT_S": "60"}
    _, out = run_ranks(3, "anysource", "dead", env=env, timeout_s=120)
    found = re.search(r"CAUGHT PeerLost rank 2 after ([0-9.]+)s: .*tag 77", out)
    assert found and float(found.group(1)) < 30, out[-3000:]
