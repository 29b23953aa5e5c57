"""Shared memory without names (issue 30.1-3): a same-user process without the job secret can
neither list nor map a job's segments, nothing of a job ever appears in /dev/shm, and a SIGKILL
at any moment of setup or with a point-to-point message never received leaves nothing behind."""
import os
import re

import pytest

from tests.multirank.harness import run_ranks

pytestmark = pytest.mark.timeout(300)
ENV = {"COMMRT_COMM_BACKEND": "zmq", "COMMRT_COMM_INTRA_NODE": "shm"}


def _pids(out: str) -> set[int]:
    return {int(p) for p in re.findall(r"pid: ([0-9]+)", out)}


def _in_dev_shm(pids: set[int]) -> list[str]:
    """/dev/shm files named after any of these processes (the segment files of commrt <= 0.x
    carried their creator's pid)."""
    return [n for n in os.listdir("/dev/shm") if any(n.startswith(f"commrt-{p}-") for p in pids)]


def test_a_process_without_the_secret_is_refused_and_finds_nothing_to_map():
    """The probe of issue 30.1: during setup the intruder finds rank 0's handoff socket, is
    refused with every secret it guesses, and finds no /dev/shm file to map; results stay right."""
    _, out = run_ranks(2, "shm_intruder", env=ENV, timeout_s=200)
    assert out.count("intruder job passed") == 2, out[-3000:]
    m = re.search(r"intruder: mapped (\d+) obtained (\d+) refused (\d+) sockets (\d+)", out)
    assert m, out[-3000:]
    mapped, obtained, refused, sockets = map(int, m.groups())
    assert (mapped, obtained) == (0, 0), out[-3000:]
    assert sockets >= 1 and refused == 3 * sockets, out[-3000:]  # it found the socket: refused each try
    assert re.findall(r"dev_shm: (.*)", out) == ["-"] * 3, out[-3000:]  # during setup, during the job


def test_a_rank_killed_in_the_handoff_is_named_and_leaves_nothing():
    """SIGKILL with its segment made and its socket listening (test_shm.py kills one while it
    maps what it was handed)."""
    before = set(os.listdir("/dev/shm"))
    _, out = run_ranks(2, "shm_faults", "handoff-kill", env=ENV, timeout_s=120, stop_on_failure=False, expect_fail=True)
    assert re.findall(r"CAUGHT PeerLost: lost peer rank 1 during connect", out), out[-3000:]
    assert len(_pids(out)) == 2, out[-3000:]
    assert not _in_dev_shm(_pids(out)), out[-3000:]
    assert not {n for n in set(os.listdir("/dev/shm")) - before if n.startswith("commrt-")}


def test_an_unreceived_ring_leaves_nothing_after_a_sigkill():
    env = {**ENV, "COMMRT_COMM_TIMEOUT_S": "20"}
    _, out = run_ranks(2, "shm_p2p", "unreceived", env=env, timeout_s=120, stop_on_failure=False,
                       expect_fail=True)
    assert re.search(r"CAUGHT PeerLost: lost peer rank 1 during recv", out), out[-3000:]
    assert re.search(r"ring: ring-[0-9a-f]+", out), out[-3000:]  # the message went into the ring
    assert len(_pids(out)) == 2 and not _in_dev_shm(_pids(out)), out[-3000:]
