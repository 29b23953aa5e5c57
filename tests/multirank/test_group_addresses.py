"""new_group on a zmq world costs a non-member nothing and a member the addresses of the partners
it dials, read from the store (issue 32.5), instead of an all-gather of every rank's addresses
over the world: 8 numpy-only ranks, with the world's hellos read per peer (2 nodes of 4) and
read all at init (no node variables, TCP only)."""
from __future__ import annotations

import ast
import io
import os
import re
import sys

import pytest

from commrt.launch import Nodes, launch
from commrt.transport import shm
from tests.multirank.harness import ROOT
from tests.multirank.programs.group_addresses import GROUPS


def _run(mode: list[str], nodes: Nodes | None, env: dict, timeout_s: float = 120.0) -> str:
    out = io.StringIO()
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "COMMRT_COMM_TIMEOUT_S": "30", "COMMRT_COMM_BACKEND": "zmq", "OMP_NUM_THREADS": "1", **env}
    cmd = [sys.executable, "-m", "tests.multirank.programs.group_addresses", *mode]
    result = launch(4 if nodes else 8, cmd, out=out, timeout_s=timeout_s, env=env, nodes=nodes)
    text = out.getvalue()
    assert result.returncode == 0, f"{result.describe()}\n{text[-6000:]}"
    return text


def _lines(text: str) -> dict[int, tuple[str, str, dict]]:
    """rank -> (lazy world?, groups on shared memory, addresses read per group) from GROUPS lines."""
    found = re.findall(r"GROUPS rank (\d+) lazy-world (\w+) shm (\[.*?\]) read (\{.*?\}) total \d+ ok", text)
    assert sorted(int(r) for r, *_ in found) == list(range(8)), text[-6000:]
    return {int(r): (lazy, shm, ast.literal_eval(read)) for r, lazy, shm, read in found}


def test_groups_with_hellos_read_per_peer():
    """2 nodes of 4: a group within a node shares memory (every entry read at creation), the
    others read the partners they dial; the 2-rank group [1, 6] reads exactly its partner's."""
    lines = _lines(_run(["groups"], Nodes(2, None), {}))
    assert all(lazy == "True" for lazy, _, _ in lines.values()), lines
    if shm.supported() is None:  # node 1's group maps its members' memory; no other group can
        assert all(lines[r][1] == "[(4, 5, 6, 7)]" for r in range(4, 8)), lines
    assert lines[1][2][(1, 6)] == 1 and lines[6][2][(1, 6)] == 1, lines
    for rank, (_, _, read) in lines.items():  # at most its partners', per group it is in
        assert all(n <= len(g) - 1 for g, n in read.items()), (rank, read)
    print({r: read for r, (_, _, read) in lines.items()})


@pytest.mark.parametrize("intra_node", ["tcp", "auto"])
def test_groups_with_every_hello_read_at_init_and_rank_0_gone_early(intra_node):
    """No node variables: the world reads every hello at init. TCP only: each group reads its
    partners' addresses when first dialled, and rank 3 first dials rank 6 in a group a second
    after rank 0 (serving the store, not a member) reached its shutdown. Shared memory (one host):
    every group of more than one rank reads its members' at creation, where rank 0 has already
    returned. Both need rank 0 to keep its store until every rank reached shutdown."""
    text = _run(["late", "every-hello"], None, {"COMMRT_COMM_INTRA_NODE": intra_node})
    lines = _lines(text)
    shares = intra_node == "auto" and shm.supported() is None
    for rank, (lazy, on_shm, _) in lines.items():
        assert lazy == "False", lines
        assert on_shm == str(sorted(tuple(g) for g in GROUPS if shares and rank in g and len(g) > 1)), lines
    assert lines[1][2][(1, 6)] == 1 and lines[6][2][(1, 6)] == 1, lines
    assert "LATE rank 6 got rank 3's message" in text, text[-6000:]
