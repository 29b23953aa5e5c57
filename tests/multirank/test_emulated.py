"""The emulated cluster (commrt launch --emulate-network): nodes as network namespaces joined by
a bridge, links shaped with tc. Needs root and iproute2; skipped with the reason otherwise
(CI runs as root). Every namespace is removed on every exit path, which these tests check."""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys

import pytest

from commrt import emulate
from commrt.topology import dispatch
from commrt.runtime.errors import ConfigError
from commrt.launch import Nodes, launch
from tests.multirank.harness import ROOT, default_signals

ENV = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "COMMRT_COMM_TIMEOUT_S": "60",
       "COMMRT_COMM_BACKEND": "zmq"}

RING = {"COMMRT_COMM_ALGORITHMS": "all_reduce=ring"}
"""Flat all_reduce as the ring, whose node crossings the byte comparisons are written for: at 2 x 2
the table's Rabenseifner pairs ranks inside the node first and crosses as little as two levels do
(14690432 B against 14680224 across nodes in the bench below)."""


@pytest.fixture
def emulated_cluster():
    """``with emulated_cluster(nnodes, "1gbit") as net`` -> emulate.Cluster; ranks are started with
    ``launch(..., nodes=Nodes(nnodes, None, emulate.node_address(0), net.wrap))``."""
    try:
        emulate.check_usable(emulate.parse_shape("1gbit"))
    except ConfigError as exc:
        pytest.skip(str(exc))

    @contextlib.contextmanager
    def make(nnodes: int, spec: str = "1gbit"):
        with emulate.cluster(nnodes, emulate.parse_shape(spec)) as net:
            yield net
        assert not [ns for ns in emulate._namespaces() if ns.startswith(net.namespaces[0].rsplit("-", 1)[0])]
    return make


def _mine() -> list[str]:
    return [ns for ns in emulate._namespaces() if ns.startswith(f"{emulate.PREFIX}{os.getpid()}-")]


def _tc_sent(ns: str, dev: str) -> int:
    out = subprocess.run(["tc", "-s", "-n", ns, "qdisc", "show", "dev", dev], capture_output=True, text=True).stdout
    return int(re.search(r"Sent (\d+) bytes", out).group(1))


def _tc_class_sent(ns: str, dev: str, classid: str) -> tuple[int, int]:
    """(bytes, packets) the htb class ``classid`` under a node link's tbf has sent."""
    out = subprocess.run(["tc", "-s", "-n", ns, "class", "show", "dev", dev], capture_output=True, text=True).stdout
    m = re.search(rf"class htb {classid} .*?\n\s*Sent (\d+) bytes (\d+) pkt", out)
    assert m, out
    return int(m.group(1)), int(m.group(2))


def run_emulated(net, k: int, m: int, *args: str, env: dict | None = None) -> str:
    out = io.StringIO()
    cmd = [sys.executable, "-m", "tests.multirank.programs.hier", str(k), str(m), *args]
    result = launch(m, cmd, out=out, timeout_s=300, env={**os.environ, **ENV, **(env or {})}, port=29500,
                    nodes=Nodes(k, None, emulate.node_address(0), net.wrap))
    assert result.returncode == 0, f"{result.describe()}\n{out.getvalue()[-6000:]}"
    return out.getvalue()


@pytest.mark.timeout(600)
def test_two_by_two_cluster_counts_and_shapes_inter_node_traffic(emulated_cluster):
    with emulated_cluster(2) as net:
        # the byte formulas are the two-level path's: "auto" chose it by a 1.19x probe at 1 Gbit on a
        # quiet machine and flat on a loaded CI run (every rank's bytes were the flat ring's)
        out = run_emulated(net, 2, 2, "bytes", env={"COMMRT_COMM_HIERARCHICAL": "always"})
        assert out.count("hier bytes passed") == 4, out[-3000:]
        # what node 0 sent to node 1 went through its shaped link: at least its ranks' inter bytes
        inter = sum(int(m.group(2)) for m in re.finditer(r"rank [01]: BYTES hier \((\d+), (\d+)\)", out))
        assert inter > 0 and _tc_sent(net.namespaces[0], "eth0") >= inter, out[-2000:]
        # node 0 received as much as it sent: its ACKs went in the small-packet class, ahead of its
        # data (one FIFO queued them behind it and slowed the peer), and the data in the other
        for ns in net.namespaces:
            cc = subprocess.run(["ip", "netns", "exec", ns, "cat", "/proc/sys/net/ipv4/tcp_congestion_control"],
                                capture_output=True, text=True, timeout=30).stdout.strip()
            assert cc == emulate.CONGESTION_CONTROL, (ns, cc)  # the node's own, not the host's
            small, bulk = _tc_class_sent(ns, "eth0", "20:1"), _tc_class_sent(ns, "eth0", "20:2")
            assert small[1] > 100 and small[0] / small[1] < emulate.SMALL_PACKET, (small, bulk)
            assert bulk[0] >= inter / 2 and bulk[0] / bulk[1] > 1000, (small, bulk)
        assert _mine(), "the namespaces exist while the cluster does"
    assert not _mine()


@pytest.mark.timeout(600)
def test_without_torchrun_variables_the_nodes_come_from_the_hosts(emulated_cluster):
    """No GROUP_RANK/LOCAL_*: each namespace's address tells the nodes apart (same host name)."""
    with emulated_cluster(2) as net:
        out = run_emulated(net, 2, 2, "mesh", env={"COMMRT_TEST_DROP_NODE_VARS": "1"})
        assert out.count("hier mesh passed") == 4, out[-3000:]


@pytest.mark.timeout(600)
def test_auto_sharding_measures_the_links_and_uses_the_node_when_across_is_slow(emulated_cluster):
    with emulated_cluster(2, "100mbit") as net:
        out = run_emulated(net, 2, 2, "links")
    found = re.findall(r"LINKS intra (\d+) inter (\d+) hpz (\d+)", out)
    assert len(found) == 4 and len(set(found)) == 1, out[-3000:]  # every rank decides the same
    intra, inter, hpz = map(int, found[0])
    assert inter * 1.5 <= intra and inter < 100e6 / 8 and hpz == 2, found[0]
    # [comm] hierarchical = "auto" times an 8 MiB all_reduce (dispatch.AUTO_PROBE_BYTES) both ways at the
    # first world collective that could go either way; every rank chooses alike, and the next
    # all_reduce takes two levels
    auto = re.findall(r"AUTO (\w+) flat ([\d.]+) two ([\d.]+) steps (.*)", out)
    assert len(auto) == 4 and len(set(a[:3] for a in auto)) == 1, out[-3000:]
    # the choice follows the probe's own figures, and the next all_reduce follows the choice; which
    # way a loaded machine measures is not asserted (issue 31.2: 1.09x under a 1.1x bar at load 11)
    chose, flat_s, two_s = auto[0][0] == "True", float(auto[0][1]), float(auto[0][2])
    assert chose == (two_s * dispatch.HIERARCHY_HELPS <= flat_s), auto[0]
    assert all(("reduce_scatter" in a[3] and "all_gather" in a[3]) == chose for a in auto), auto


def _run_launcher(args: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    """``commrt launch ARGS`` to the end; the result's ``pid`` is the launcher's, which names its
    namespaces (another emulated job on this host, e.g. a second test run, has its own)."""
    with subprocess.Popen([sys.executable, "-m", "commrt.cli", "launch", *args], env={**os.environ, **ENV}, cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as p:
        try:
            out, err = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        result = subprocess.CompletedProcess(p.args, p.returncode, out, err)
        result.pid = p.pid
        return result


def _launchers_namespaces(pid: int) -> list[str]:
    return [ns for ns in emulate._namespaces() if ns.startswith(f"{emulate.PREFIX}{pid}-")]


@pytest.mark.timeout(600)
def test_cli_emulated_cluster_runs_and_leaves_nothing(emulated_cluster):
    proc = _run_launcher(["--nnodes", "3", "--nproc-per-node", "2", "--emulate-network", "1gbit", "--timeout", "300",
                          "--", sys.executable, "-m", "tests.multirank.programs.hier", "3", "2", "mesh"], 400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.stdout.count("hier mesh passed") == 6
    assert not _launchers_namespaces(proc.pid), "leftover namespaces"


@pytest.mark.timeout(300)
def test_a_crashing_rank_and_ctrl_c_leave_no_namespaces(emulated_cluster):
    crash = _run_launcher(["--nnodes", "2", "-n", "1", "--emulate-network", "100mbit", "--", sys.executable, "-c",
                           "import sys; sys.exit(3)"], 120)
    assert crash.returncode == 3, crash.stderr
    assert not _launchers_namespaces(crash.pid)
    p = subprocess.Popen([sys.executable, "-m", "commrt.cli", "launch", "--nnodes", "2", "-n", "1",
                          "--emulate-network", "100mbit", "--", sys.executable, "-c",
                          "import time; print('up', flush=True); time.sleep(600)"],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_signals)
    try:
        assert "up" in p.stdout.readline()  # a rank runs inside a namespace: the cluster exists
        assert [ns for ns in emulate._namespaces() if ns.startswith(f"{emulate.PREFIX}{p.pid}-")]
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=60) == 130
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert not [ns for ns in emulate._namespaces() if ns.startswith(f"{emulate.PREFIX}{p.pid}-")]


def test_leftovers_of_a_killed_run_are_removed_next_time(emulated_cluster):
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid names a launcher that no longer runs
    name = f"{emulate.PREFIX}{dead.pid}-dead00-n0"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        with emulated_cluster(1):
            assert name not in emulate._namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_a_delay_needs_netem_and_says_so(emulated_cluster):
    try:
        with emulated_cluster(1, "1gbit,0.2ms"):
            pass  # this kernel has netem
    except ConfigError as exc:
        assert "netem" in str(exc) and "RATE" in str(exc), exc
    assert not _mine()


def test_not_root_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ConfigError, match="needs root"):
        emulate.check_usable(emulate.parse_shape("1gbit"))


@pytest.mark.timeout(300)
def test_bench_prints_intra_and_inter_node_bytes_flat_and_hierarchical(emulated_cluster):
    proc = subprocess.run([sys.executable, "-m", "commrt.cli", "launch", "--nnodes", "2", "-n", "2",
                           "--emulate-network", "1gbit", "--", sys.executable, "-m", "commrt.cli", "bench",
                           "all_reduce", "--backend", "zmq,zmq+hier", "-b", "1M", "-e", "1M", "-n", "2", "-w", "1"],
                          env={**os.environ, **ENV, **RING}, cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    sent = {m.group(1): (int(m.group(2)), int(m.group(3))) for m in re.finditer(
        r"# (zmq\+?h?i?e?r?): sent inside nodes (\d+) B, across nodes (\d+) B", proc.stdout)}
    assert set(sent) == {"zmq", "zmq+hier"}, proc.stdout[-3000:]
    assert sent["zmq+hier"][1] < sent["zmq"][1]  # the point of it: fewer bytes across nodes than the ring


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_zeropp_on_the_emulated_cluster_tracks_exact_zero3(emulated_cluster):
    """ZeRO-3 + qwZ + qgZ + hpZ at 2 x 2 over a 1 Gbit link: the quantized gathers and gradient
    reductions take the two-hop path (only the link quantized), the loss stays within 10% of the
    exact run's drop and every rank ends with the same parameters (programs/quant_zero.py)."""
    out = io.StringIO()
    with emulated_cluster(2, "1gbit") as net:
        result = launch(2, [sys.executable, "-m", "tests.multirank.programs.quant_zero", "30"], out=out,
                        timeout_s=500, env={**os.environ, **ENV, "COMMRT_COMM_HIERARCHICAL": "always"}, port=29500,
                        nodes=Nodes(2, None, emulate.node_address(0), net.wrap))
    assert result.returncode == 0 and out.getvalue().count("quant zero passed") == 4, out.getvalue()[-6000:]


@pytest.mark.timeout(600)
def test_estimate_measure_times_the_links_of_the_job_it_runs_in(emulated_cluster):
    """``commrt estimate --measure`` under a 2x2 emulated launch at 100 Mbit: the node's link
    across is measured near its shaped rate (the model's inter-bw, per node), the path inside the
    node far above it, rank 0 alone prints, and the predicted times use the measured figures."""
    from commrt.plan.estimate import Cluster, Job, estimate
    cmd = [sys.executable, "-m", "commrt.cli", "launch", "--nnodes", "2", "--nproc-per-node", "2",
           "--emulate-network", "100mbit", "--timeout", "300", "--", sys.executable, "-m", "commrt.cli",
           "estimate", "--measure", "--measure-bytes", "2M", "--params", "1e6", "--nodes", "2", "--per-node", "2",
           "--stage", "3", "--json"]
    proc = subprocess.run(cmd, env={**os.environ, **ENV}, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    text = "\n".join(line.split("] ", 1)[1] for line in proc.stdout.splitlines() if line.startswith("[rank 0] "))
    assert not re.search(r"^\[rank [123]\] [\[{#]", proc.stdout, re.M), proc.stdout[-3000:]  # rank 0 alone prints
    (result,) = json.loads(("\n" + text)[("\n" + text).index("\n["):])
    c = result["cluster"]
    # the shaped node link, ~12.5 MB/s: the measured busbw times the 2 ranks per node, which assumes
    # both cross at once; when their all_reduces overlap only in part it reads up to 2x (seen: 1.6x
    # in a fresh-clone run). A missing per-node factor reads 0.5x and fails the lower bound.
    assert 0.5 * 100e6 / 8 <= c["inter_bw"] <= 2.0 * 100e6 / 8, c
    assert c["intra_bw"] >= 4 * c["inter_bw"], c
    assert "across nodes" in result["measured"] and "measured" in result["measured"]
    est = estimate(Job(params=1_000_000, stage=3), Cluster(**c))
    assert result["seconds"] == pytest.approx(est.seconds) and est.seconds["total"] > 0
