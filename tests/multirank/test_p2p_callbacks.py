"""Done-callbacks that post point-to-point operations (the docs allow async ops in them)."""
import pytest

from tests.multirank.harness import run_ranks

pytestmark = pytest.mark.timeout(120)


def test_a_done_callback_that_sends_does_not_deadlock_a_sending_thread():
    """The engine thread ran a finished zero-copy send's callbacks while holding its lock; a
    callback's isend then waited for the group's p2p lock, held by the main thread's isend,
    which waited for the engine's lock: both ranks hung with no deadline (review_pp item 1)."""
    env = {"COMMRT_COMM_BACKEND": "zmq", "COMMRT_COMM_INTRA_NODE": "tcp", "COMMRT_COMM_TIMEOUT_S": "20"}
    _, out = run_ranks(2, "p2p_callbacks", "chain", env=env, timeout_s=45)
    assert "chain passed" in out, out[-3000:]
