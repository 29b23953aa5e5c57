"""A store per node (issue 32.5): 3 nodes of 2 ranks on this host (the launcher's node
variables), numpy-only ranks. Rank 0's store serves one connection per other node (its node's
leader's proxy) plus its own node's ranks, instead of one per rank; collectives, new_group and
shutdown work as before; a node whose leader dies fails its ranks' store calls with a typed
error within their deadline."""
from __future__ import annotations

import io
import os
import re
import sys

import pytest

from commrt.launch import Nodes, launch
from tests.multirank.harness import ROOT


def _run(nodes: int, per_node: int, mode: str, timeout_s: float = 120.0, **env_extra):
    out = io.StringIO()
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "COMMRT_COMM_TIMEOUT_S": "60", "COMMRT_COMM_BACKEND": "zmq", "OMP_NUM_THREADS": "1", **env_extra}
    cmd = [sys.executable, "-m", "tests.multirank.programs.store_proxy", mode]
    result = launch(per_node, cmd, out=out, timeout_s=timeout_s, env=env, nodes=Nodes(nodes, None),
                    stop_on_failure=mode != "leader_dies")
    text = out.getvalue()
    assert result.returncode != 124, f"timed out:\n{text[-6000:]}"
    return result, text


@pytest.mark.parametrize("proxy,expect,security", [("true", 2 + 2, "secret"), ("false", 6, "secret"),
                                                   ("true", 2 + 2, "curve")])
def test_rank_0s_store_serves_one_connection_per_node(proxy, expect, security):
    """Under curve the proxy is authenticated by its leader's key, upstream and down."""
    result, out = _run(3, 2, "ops", COMMRT_CLUSTER_STORE_PROXY=proxy, COMMRT_SECURITY_MODE=security)
    assert result.returncode == 0, f"{result.describe()}\n{out[-6000:]}"
    assert sorted(int(r) for r in re.findall(r"OK rank (\d+)", out)) == list(range(6)), out[-6000:]
    # with proxies: node 0's 2 ranks and nodes 1 and 2's proxies; without: every rank
    assert re.search(rf"STORE rank 0 served {expect} connections", out), out[-6000:]
    proxies = re.findall(r"PROXY node (\d+) rank (\d+) served (\d+) ranks", out)
    assert sorted(proxies) == ([("1", "2", "2"), ("2", "4", "2")] if proxy == "true" else []), proxies


def test_a_dead_leader_fails_its_nodes_store_calls_within_the_deadline():
    result, out = _run(3, 2, "leader_dies", timeout_s=90)
    probes = dict(re.findall(r"PROBE rank (\d+) (.*)", out))
    assert probes.get("5") == "ok", out[-6000:]  # node 2's proxy still forwards
    failed = re.match(r"failed after ([\d.]+)s: (.*)", probes.get("3", ""))
    assert failed, out[-6000:]
    assert float(failed.group(1)) < 3.0 + 2.0, failed.group(0)
    assert "via the store proxy of node 1 on rank 2 stopped answering (add" in failed.group(2), failed.group(2)
