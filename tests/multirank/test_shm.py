"""The intra-node shared-memory path: every collective against the single-process reference
(n = 2, 3, 4; one-step and pipelined sizes), a mismatch and a dead peer become typed errors,
and no segment ever has a name in /dev/shm (test_shm_nameless.py has the attacks)."""
import os
import re

import pytest

from tests.multirank.harness import run_ranks

pytestmark = pytest.mark.timeout(330)
SLOT = str(64 << 10)  # small slots: modest sizes run many pipelined rounds
ENV = {"COMMRT_COMM_BACKEND": "zmq", "COMMRT_COMM_INTRA_NODE": "shm", "COMMRT_COMM_SMALL_BYTES": "4096"}


def _segments(out: str) -> set[str]:
    return {name for line in re.findall(r"segments: (.*)", out) for name in line.split()}


def _left_in_dev_shm(out: str) -> list[str]:
    """/dev/shm files named after the job's processes (segment files carried their creator's pid)."""
    pids = set(re.findall(r"pid: ([0-9]+)", out))
    assert pids, out[-3000:]
    return [n for n in os.listdir("/dev/shm") if n.startswith("commrt-") and n.split("-")[1] in pids]


@pytest.mark.parametrize("nproc", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_every_collective_matches_the_reference(nproc):
    _, out = run_ranks(nproc, "shm_job", SLOT, env=ENV, timeout_s=300)
    assert out.count("shm passed") == nproc
    names = _segments(out)  # each rank's handoff socket
    assert len(names) == nproc and all(n.startswith("commrt-") for n in names), out


@pytest.mark.parametrize("nproc", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_a_rank_killed_during_setup_leaves_nothing_in_dev_shm(nproc):
    """SIGKILL while mapping what its peers handed it: the survivors name the victim, and
    nothing of the group has a name anywhere (the memory goes with the last process)."""
    _, out = run_ranks(nproc, "shm_faults", "setup-kill", env=ENV, timeout_s=120, stop_on_failure=False,
                       expect_fail=True)
    caught = re.findall(r"CAUGHT PeerLost: lost peer rank 1 during connect", out)
    assert len(caught) == nproc - 1, out
    assert not _left_in_dev_shm(out), out


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
    assert not _left_in_dev_shm(out)
