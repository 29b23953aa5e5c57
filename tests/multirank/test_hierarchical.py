"""Topology, device mesh and hierarchical collectives on real ranks over loopback, with the node
layout forced by the launcher (torchrun's GROUP_RANK / LOCAL_RANK / LOCAL_WORLD_SIZE)."""
from __future__ import annotations

import io
import os
import sys

import pytest

from commrt.launch import Nodes, launch
from tests.multirank.harness import ROOT


def run_layout(k: int, m: int, *args: str, env: dict | None = None, timeout_s: float = 240.0,
               expect_fail: bool = False) -> str:
    """``k`` nodes of ``m`` ranks, all on this host (``Nodes(node_rank=None)``)."""
    out = io.StringIO()
    full_env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                "COMMRT_COMM_TIMEOUT_S": "60", "COMMRT_COMM_BACKEND": "zmq", **(env or {})}
    cmd = [sys.executable, "-m", "tests.multirank.programs.hier", str(k), str(m), *args]
    result = launch(m, cmd, out=out, timeout_s=timeout_s, env=full_env, nodes=Nodes(k, None))
    text = out.getvalue()
    assert result.returncode != 124, f"timed out:\n{text[-6000:]}"
    if expect_fail:
        assert result.returncode != 0, text[-3000:]
    else:
        assert result.returncode == 0, f"{result.describe()}\n{text[-6000:]}"
    return text


@pytest.mark.parametrize("k,m", [(2, 2), (3, 2)])
def test_topology_getters_and_mesh(k, m):
    out = run_layout(k, m, "mesh")
    assert out.count("hier mesh passed") == k * m


@pytest.mark.parametrize("k,m", [(2, 2), (3, 2)])
def test_hierarchical_matrix_equals_the_reference_on_every_rank(k, m):
    out = run_layout(k, m, "matrix", env={"COMMRT_COMM_HIERARCHICAL": "always"})
    assert out.count("hier matrix passed") == k * m


@pytest.mark.parametrize("k,m", [(2, 2), (3, 2)])
def test_byte_counters_follow_the_formulas(k, m):
    out = run_layout(k, m, "bytes", env={"COMMRT_COMM_HIERARCHICAL": "auto"})
    assert out.count("hier bytes passed") == k * m


def test_a_non_contiguous_layout_is_a_rendezvous_error():
    """Rank 1 claims to be on node 1 while ranks 0 and 2 are on node 0."""
    out = run_layout(1, 3, "mesh", env={"COMMRT_TEST_SWAP_GROUP_RANK": "1"}, expect_fail=True)
    assert "RendezvousError" in out and "contiguous" in out, out[-3000:]
