"""The intra-node shared-memory path: every collective against the single-process reference
(n = 2, 3, 4; one-step and pipelined sizes), nothing left in /dev/shm after any exit, a
mismatch and a dead peer become typed errors."""
import os
import re

import pytest

from tests.multirank.harness import run_ranks

pytestmark = pytest.mark.timeout(330)
SLOT = str(64 << 10)  # small slots: modest sizes run many pipelined rounds
ENV = {"COMMRT_COMM_BACKEND": "zmq", "COMMRT_COMM_INTRA_NODE": "shm", "COMMRT_COMM_SMALL_BYTES": "4096"}


def _segments(out: str) -> set[str]:
    return {name for line in re.findall(r"segments: (.*)", out) for name in line.split()}


def _left_in_dev_shm(names: set[str]) -> list[str]:
    return [n for n in names if os.path.exists(os.path.join("/dev/shm", n))]


@pytest.mark.parametrize("nproc", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_every_collective_matches_the_reference(nproc):
    _, out = run_ranks(nproc, "shm_job", SLOT, env=ENV, timeout_s=300)
    assert out.count("shm passed") == nproc
    names = _segments(out)
    assert len(names) == nproc, out
    assert not _left_in_dev_shm(names)


def _segments_made(out: str) -> set[str]:
    return set(re.findall(r"segment: (commrt-[0-9]+-[0-9a-f]+)", out))


@pytest.mark.parametrize("nproc", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_a_rank_killed_during_setup_leaves_nothing_in_dev_shm(nproc):
    """SIGKILL after every segment exists and before any is unlinked: the survivors name the
    victim and remove every name of the group, the victim's included."""
    _, out = run_ranks(nproc, "shm_faults", "setup-kill", env=ENV, timeout_s=120, stop_on_failure=False,
                       expect_fail=True)
    names = _segments_made(out)
    assert len(names) == nproc, out
    caught = re.findall(r"CAUGHT PeerLost: lost peer rank 1 during connect", out)
    assert len(caught) == nproc - 1, out
    assert not _left_in_dev_shm(names), out


def test_a_mismatch_is_a_typed_error_on_every_rank():
    _, out = run_ranks(3, "shm_faults", "mismatch", env=ENV, timeout_s=120)
    # seq 1: the barrier over TCP that admits the peers; 2: the init barrier; 3: the bad all_reduce
    caught = re.findall(r"CAUGHT CollectiveMismatch: collective mismatch at seq 3", out)
    assert len(caught) == 3, out


@pytest.mark.slow
def test_garbage_in_a_peers_control_page_is_a_typed_error():
    """The reader names the scribbler; the scribbler then loses its peer: typed errors, no crash."""
    _, out = run_ranks(2, "shm_faults", "garbage", env=ENV, timeout_s=120)
    assert "[rank 0] CAUGHT CollectiveMismatch" in out, out
    assert re.search(r"\[rank 1\] CAUGHT (CollectiveMismatch|PeerLost)", out), out
    assert not _left_in_dev_shm(_segments_made(out))
