"""A store per node (issue 32.5): 3 nodes of 2 ranks on this host (the launcher's node
variables), numpy-only ranks. Rank 0's store serves one connection per other node (its node's
leader's proxy) plus its own node's ranks, instead of one per rank; collectives, new_group and
shutdown work as before; a node whose leader dies fails its ranks' store calls with a typed
error within about a heartbeat interval; a rank whose store_proxy setting differs from its
leader's gets the config digest error."""
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


def test_a_dead_leader_fails_its_nodes_store_calls_within_a_heartbeat():
    """Rank 3's wait (20 s) and its next call (5 s deadline) fail about a heartbeat interval
    (1 s) after its leader's death; before, each waited out its deadline (25 s, then 5 s)."""
    result, out = _run(3, 2, "leader_dies", timeout_s=90)
    probes = {(r, what): how for r, what, how in re.findall(r"PROBE rank (\d+) (\w+) (.*)", out)}
    assert probes.get(("5", "add")) == "ok", out[-6000:]  # node 2's proxy still forwards
    for what in ("wait", "add"):
        failed = re.match(r"failed after ([\d.]+)s: (.*)", probes.get(("3", what), ""))
        assert failed, out[-6000:]
        assert float(failed.group(1)) < 4.0, failed.group(0)  # a hang bound, well inside the deadlines
        assert f"via the store proxy of node 1 on rank 2 lost its connection" in failed.group(2), failed.group(2)
        assert f"({what}): the store proxy of node 1 on rank 2 exited" in failed.group(2), failed.group(2)


def test_a_rank_whose_store_proxy_setting_differs_gets_the_config_digest_error():
    """Rank 3 expects a proxy its leader (store_proxy false) does not serve: it dials the store
    itself and every rank fails on the digest naming rank 3 (before: rank 3 timed out waiting
    for the proxy, the others for rank 3)."""
    result, out = _run(2, 2, "proxy_mismatch", timeout_s=60, COMMRT_CLUSTER_STORE_PROXY="false",
                       COMMRT_COMM_TIMEOUT_S="20")
    assert result.returncode == 0, f"{result.describe()}\n{out[-6000:]}"
    errors = re.findall(r"CAUGHT RendezvousError: (.*)", out)
    assert len(errors) == 4, out[-6000:]
    assert all(re.search(r"rank 3 \(.*\) has config digest .*, rank 0 has", m) for m in errors), errors
