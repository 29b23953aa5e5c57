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


TWO_BY_TWO = pytest.mark.xdist_group("hier_2x2")  # one worker runs both: the launch runs once


@pytest.fixture(scope="module")
def matrix_and_strided_2x2():
    """One launch of 2 x 2 ranks (at 4 ranks on two cores a launch costs ~8 s of imports) for the
    matrix at 4 MiB chunks (the default: every all_reduce in one piece) and the strided views."""
    return run_layout(2, 2, "matrix", "strided", env={"COMMRT_COMM_HIERARCHICAL": "always",
                                                      "COMMRT_COMM_CHUNK_BYTES": str(4 << 20)})


@pytest.mark.parametrize("k,m,chunk", [pytest.param(2, 2, 4 << 20, marks=TWO_BY_TWO), (3, 2, 16 << 10)])
def test_hierarchical_matrix_equals_the_reference_on_every_rank(k, m, chunk, request):
    """16 KiB chunks: the larger all_reduces run as 2-4 pipelined pieces (one padded)."""
    if (k, m) == (2, 2):
        out = request.getfixturevalue("matrix_and_strided_2x2")
    else:
        out = run_layout(k, m, "matrix", env={"COMMRT_COMM_HIERARCHICAL": "always",
                                              "COMMRT_COMM_CHUNK_BYTES": str(chunk)})
    assert out.count("hier matrix passed") == k * m


@TWO_BY_TWO
def test_strided_views_on_some_ranks_take_the_two_levels_like_the_others(matrix_and_strided_2x2):
    """Which path an op takes depends on what every rank agrees on, not on one rank's memory
    layout: the strided views run on a copy (dispatch._plain). A regression waits out
    run_layout's 60 s deadline (the launch is the matrix's too), then fails."""
    assert matrix_and_strided_2x2.count("hier strided passed") == 4


@pytest.mark.parametrize("k,m", [(2, 2), (3, 2)])
def test_byte_counters_follow_the_formulas(k, m):
    """The formulas are the ring's (node-boundary crossings per ring edge): programs/hier.py pins
    the ring for "bytes", as the 3 MiB flat all_reduce would take the table's Rabenseifner."""
    out = run_layout(k, m, "bytes", env={"COMMRT_COMM_HIERARCHICAL": "always"})
    assert out.count("hier bytes passed") == k * m


def test_a_non_contiguous_layout_is_a_rendezvous_error():
    """Rank 1 claims to be on node 1 while ranks 0 and 2 are on node 0."""
    out = run_layout(1, 3, "mesh", env={"COMMRT_TEST_SWAP_GROUP_RANK": "1"}, expect_fail=True)
    assert "RendezvousError" in out and "contiguous" in out, out[-3000:]


def test_cli_launches_one_node_per_invocation_like_torchrun():
    """Two `commrt launch --nnodes 2 --node-rank R` (one per "host"), meeting at --master-addr."""
    import subprocess

    from commrt.launch import free_port
    from commrt.transport.security import new_secret
    port = free_port()
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "COMMRT_COMM_TIMEOUT_S": "60", "COMMRT_COMM_BACKEND": "zmq", "COMMRT_JOB_SECRET": new_secret()}
    procs = [subprocess.Popen([sys.executable, "-m", "commrt.cli", "launch", "--nnodes", "2", "--node-rank", str(r),
                               "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
                               "--timeout", "200", "--", sys.executable, "-m", "tests.multirank.programs.hier",
                               "2", "2", "mesh"], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in (1, 0)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert "[rank 2] rank 2: hier mesh passed" in outs[0] and "[rank 0] rank 0: hier mesh passed" in outs[1], outs


def test_cli_refuses_a_multi_node_launch_without_its_rendezvous():
    import subprocess
    proc = subprocess.run([sys.executable, "-m", "commrt.cli", "launch", "--nnodes", "2", "-n", "1", "--", "true"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "--node-rank, --master-addr and --master-port" in proc.stderr, proc.stderr


def test_auto_routes_that_disagree_on_size_are_a_mismatch_not_a_wait():
    """2 nodes of 2, "auto" with two levels chosen: rank 0 all_reduces 2 MiB, the others 1 KiB.
    Routing by its own size, rank 0 took the node groups and the others the flat world, and
    every rank waited out the deadline (20 s here); with the debug aid on, every rank must name
    the mismatch (without it they still wait: the check costs a barrier per op)."""
    out = run_layout(2, 2, "sizes", env={"COMMRT_COMM_HIERARCHICAL": "auto", "COMMRT_COMM_TIMEOUT_S": "20",
                                         "COMMRT_COMM_CHECK_CALL_SITES": "1"})
    caught = [line for line in out.splitlines() if "CAUGHT CollectiveMismatch" in line]
    assert len(caught) == 4, out[-6000:]


def test_uneven_nodes_agree_on_every_rank_and_run_flat():
    """Nodes of 3 and 1 ranks: measure_links (what "auto" sharding calls) returned None on the
    lone rank but divided by zero on the others building a (2, 0) mesh; now every rank gets None,
    node_groups is a ConfigError naming the node sizes, and collectives run flat. An Engine
    with "auto" sharding planned from each rank's own node size (hybrid on the lone rank, flat
    on the others) and the ranks built different groups: now one plan on every rank."""
    from tests.multirank.harness import run_ranks
    _, text = run_ranks(4, "uneven_nodes", "3", "1", timeout_s=90,
                        env={"COMMRT_COMM_TIMEOUT_S": "20", "COMMRT_COMM_BACKEND": "zmq",
                             "COMMRT_COMM_HIERARCHICAL": "always"})
    assert text.count("uneven passed") == 4, text[-3000:]
