"""The zmq world's rendezvous reads a peer's hello only when it first dials it (issue 32.5):
16 ranks laid out as 4 nodes of 4 on this host (the launcher's node variables), numpy-only ranks."""
from __future__ import annotations

import io
import os
import re
import sys

from commrt.launch import Nodes, launch
from tests.multirank.harness import ROOT


def _run(nodes: int, per_node: int, mode: str, timeout_s: float = 240.0):
    out = io.StringIO()
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "COMMRT_COMM_TIMEOUT_S": "60", "COMMRT_COMM_BACKEND": "zmq", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "tests.multirank.programs.lazy_hellos", mode]
    result = launch(per_node, cmd, out=out, timeout_s=timeout_s, env=env, nodes=Nodes(nodes, None))
    text = out.getvalue()
    assert result.returncode != 124, f"timed out:\n{text[-6000:]}"
    return result, text


def test_ranks_read_the_hellos_of_their_node_and_of_the_peers_they_dial():
    result, out = _run(4, 4, "ops")
    assert result.returncode == 0, f"{result.describe()}\n{out[-6000:]}"
    reads = {int(r): int(k) for r, k in re.findall(r"HELLOS rank (\d+) world 16 read (\d+) then 15 ok", out)}
    assert sorted(reads) == list(range(16)), out[-6000:]
    # before: 16 each (every rank read every hello). Now rank 0's (checked against), 3 of its
    # node and the barrier's and recursive doubling's partners (rank +- 2^k, rank xor 2^k): at
    # most 9 here (the program checks each rank's count exactly against what it dialled)
    assert reads[0] == 16 and max(reads[r] for r in range(1, 16)) <= 9, reads
    print("hellos read per rank after init + all_reduce:", reads)


def test_a_mismatched_config_fails_every_rank_naming_both_sides():
    result, out = _run(2, 4, "mismatch", timeout_s=120)
    assert result.returncode == 0, f"{result.describe()}\n{out[-6000:]}"
    errors = re.findall(r"CAUGHT RendezvousError: (.*)", out)
    assert len(errors) == 8, out[-6000:]
    odd = [m for m in errors if not re.search(r"rank 5 \(.*\) has config digest .*, rank 0 has", m)]
    assert not odd, odd


def test_a_peer_first_dialled_after_rank_0_left_is_still_found():
    result, out = _run(2, 4, "late", timeout_s=120)
    assert result.returncode == 0 and "LATE rank 6 got rank 3's message" in out, \
        f"{result.describe()}\n{out[-6000:]}"
