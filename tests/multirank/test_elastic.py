"""Elastic restarts across nodes (issue 33 items 1 and 4): one ``commrt launch --nnodes MIN:MAX``
per node; a node's launcher is killed with SIGKILL (its ranks die with it), the others stop their
ranks, re-form without it and resume from the last complete checkpoint; the launcher comes back
and the job returns to its full size. The final parameters must equal plain torch on one process
over the same steps (every step's global batch is the same whatever the world size, so the
reference replays each generation's steps as they were), and the times from the kill to the next
completed step and from the restart to the first step at full size are printed and bounded.

The short version runs 2 nodes on loopback; the emulated one 3 nodes, each in a network namespace
(emulate.py), killing node 2 — or cutting its link (``ip link set down``)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from commrt import emulate
from commrt.launch import free_port
from commrt.transport.security import new_secret
from tests.multirank.harness import ROOT, default_signals, emulated_cluster
from tests.multirank.programs.elastic_job import reference

STEPS, PAUSE_S = 60, 0.4
REFORM_TARGET_S = 60.0


class Job:
    """The launchers of one elastic job, each writing its output to a file."""

    def __init__(self, tmp_path, nnodes: str, max_nodes: int, master: str, net=None):
        wrap = _wrap(net) if net else None
        self.net = net
        self.dir, self.max_nodes, self.master, self.wrap = tmp_path, max_nodes, master, wrap or (lambda n: ([], {}))
        (tmp_path / "ckpt").mkdir()
        self.nnodes, self.procs, self.logs, self.port = nnodes, {}, {}, 29500 if wrap else free_port()
        self.env = {**os.environ, "PYTHONPATH": ROOT, "COMMRT_COMM_BACKEND": "zmq", "COMMRT_COMM_TIMEOUT_S": "60",
                    "COMMRT_JOB_SECRET": new_secret()}  # every node the same secret, as a scheduler would give

    def start(self, node: int) -> None:
        argv, extra = self.wrap(node)
        log = self.dir / f"node{node}.{len([k for k in self.logs if k[0] == node])}.log"
        self.logs[(node, log.name)] = log
        cmd = [*argv, sys.executable, "-m", "commrt.cli", "launch", "-n", "1", "--nnodes", self.nnodes,
               "--node-rank", str(node), "--master-addr", self.master, "--master-port", str(self.port),
               "--rdzv-timeout", "60", "--timeout", "240", "--",
               sys.executable, "-m", "tests.multirank.programs.elastic_job", str(self.dir / "ckpt"), str(STEPS),
               str(PAUSE_S)]
        with open(log, "w") as fh:
            self.procs[node] = subprocess.Popen(cmd, env={**self.env, **extra}, stdout=fh, stderr=subprocess.STDOUT,
                                                cwd=ROOT, preexec_fn=default_signals)

    def progress(self) -> list[dict]:
        path = self.dir / "ckpt" / "progress.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def wait_for(self, what: str, check, deadline_s: float = 120.0) -> dict:
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            found = [p for p in self.progress() if check(p)]
            if found:
                return found[0]
            if any(p.poll() not in (None, 0) for p in self.procs.values()) or \
                    all(p.poll() is not None for p in self.procs.values()):
                break  # a launcher failed, or the job ended without it
            time.sleep(0.1)
        raise AssertionError(f"no {what} within {deadline_s}s; progress {self.progress()[-5:]}\n{self.output()}")

    def output(self, tail: int | None = 4000) -> str:
        return "\n".join(f"--- {name} ---\n{path.read_text()[-tail if tail else 0:]}"
                         for (_, name), path in self.logs.items())

    def link(self, node: int, state: str) -> None:
        subprocess.run(["ip", "-n", self.net.namespaces[node], "link", "set", "eth0", state], check=True, timeout=30)

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)


def lose_and_regain(job: Job, victim: int, full: int, how: str = "kill") -> dict:
    """Run the job to the end, taking ``victim`` away at step 3 and back after the resume."""
    for n in range(full):
        job.start(n)
    job.wait_for("a step at full size", lambda p: p["world"] == full and p["step"] >= 3)
    t_kill = time.time()
    if how == "kill":
        killed = job.procs.pop(victim)
        killed.send_signal(signal.SIGKILL)
        assert killed.wait(10) == -signal.SIGKILL
    else:  # the node's link goes down: its launcher and ranks live on, cut off
        job.link(victim, "down")
    resumed = job.wait_for("a step after the loss", lambda p: p["time"] > t_kill and p["world"] == full - 1)
    t_back = time.time()
    if how == "kill":
        job.start(victim)
    else:  # the same launcher, still waiting for the rendezvous, joins the next generation
        job.link(victim, "up")
    regained = job.wait_for("a step at full size again", lambda p: p["time"] > t_back and p["world"] == full)
    for n, p in job.procs.items():
        assert p.wait(180) == 0, f"node {n}'s launcher ended with {p.returncode}\n{job.output()}"
    final = json.loads((job.dir / "ckpt" / "final.json").read_text())
    ref = reference(STEPS)
    worst = max(abs(a - b) for k in ref for a, b in zip(final[k], ref[k]))
    text = job.output(tail=None)
    times = {"kill_to_step_s": resumed["time"] - t_kill, "restart_to_full_s": regained["time"] - t_back,
             "max_abs_diff": worst}
    print(f"elastic {full}->{full - 1}->{full} ({how}): {json.dumps(times)}")
    assert set(final) == set(ref) and worst <= 1e-5, (worst, text)
    gens = sorted({(p["generation"], p["world"]) for p in job.progress()})
    assert [w for _, w in gens] == [full, full - 1, full], gens  # exactly two re-forms
    assert "resumes at step 0" in text and text.count("resumes at step 0") == full, text  # only gen 0 starts fresh
    # the loss is named, even when a survivor's rank failed first (PeerLost names the lost rank sooner)
    assert re.search(rf"generation 1: nodes .*\(node {victim} stopped beating", text), text
    assert f"node {victim} joined" in text, text
    assert times["kill_to_step_s"] < REFORM_TARGET_S and times["restart_to_full_s"] < REFORM_TARGET_S, times
    return times


@pytest.fixture
def job_factory(tmp_path):
    jobs = []

    def make(*args, **kw) -> Job:
        jobs.append(Job(tmp_path, *args, **kw))
        return jobs[-1]
    yield make
    for j in jobs:
        j.stop()


@pytest.mark.slow  # 40-80 s of restarts and heartbeat waits: CI runs the unit tests of runtime/elastic.py
def test_two_nodes_on_loopback_lose_one_and_regain_it(job_factory):
    lose_and_regain(job_factory("1:2", 2, "127.0.0.1"), victim=1, full=2)


@pytest.mark.slow
def test_three_emulated_nodes_lose_one_and_regain_it(job_factory):
    with emulated_cluster(3) as net:
        job = job_factory("2:3", 3, emulate.node_address(0), net=net)
        lose_and_regain(job, victim=2, full=3)


@pytest.mark.slow
def test_three_emulated_nodes_one_link_down_and_up(job_factory):
    with emulated_cluster(3) as net:
        job = job_factory("2:3", 3, emulate.node_address(0), net=net)
        lose_and_regain(job, victim=2, full=3, how="link")


def _wrap(net):
    def wrap(node: int):
        return ["ip", "netns", "exec", net.namespaces[node]], {"COMMRT_CLUSTER_BIND_HOST": emulate.node_address(node),
                                                               "COMMRT_SECURITY_ALLOW_INSECURE": "1"}
    return wrap


def test_a_launcher_without_the_job_secret_cannot_join_and_both_exit_saying_why(tmp_path):
    """The rendezvous is authenticated like every commrt store: node 1 with another secret is never
    answered (exit 4, EXIT_LOST); node 0 cannot gather MIN = 2 nodes (exit 3, EXIT_TOO_FEW)."""
    port = free_port()
    base = {**os.environ, "PYTHONPATH": ROOT}
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "commrt.cli", "launch", "-n", "1", "--nnodes", "2:2", "--node-rank", str(node),
               "--master-addr", "127.0.0.1", "--master-port", str(port), "--rdzv-timeout", "5", "--timeout", "60",
               "--", sys.executable, "-c", "pass"]
        procs.append(subprocess.Popen(cmd, env={**base, "COMMRT_JOB_SECRET": new_secret()}, cwd=ROOT, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=default_signals))
    outs = [p.communicate(timeout=90)[0] for p in procs]
    assert procs[0].returncode == 3 and "only 1 node(s) [0] ready within 5s" in outs[0], outs
    assert procs[1].returncode == 4 and "did not answer within 5s" in outs[1], outs


def test_a_rank_failing_after_the_other_node_finished_ends_both_launchers_with_its_code(tmp_path):
    """Node 0's rank exits 0 at once, node 1's with 7 half a second later: both launchers end with 7,
    saying why, within seconds (before: node 0 exited 0 after the join deadline, node 1 with 4,
    EXIT_LOST, after another)."""
    port, secret = free_port(), new_secret()
    rank = "import os, sys, time; n = os.environ['COMMRT_NODE_ID']; time.sleep(0.5 * (n == '1')); sys.exit(7 * (n == '1'))"
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "commrt.cli", "launch", "-n", "1", "--nnodes", "2:2", "--node-rank", str(node),
               "--master-addr", "127.0.0.1", "--master-port", str(port), "--rdzv-timeout", "30",
               "--max-restarts", "2", "--timeout", "90", "--", sys.executable, "-c", rank]
        procs.append(subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": ROOT, "COMMRT_JOB_SECRET": secret},
                                      cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      preexec_fn=default_signals))
    outs = [p.communicate(timeout=120)[0] for p in procs]
    why = "node 1: rank 0 exited with code 7 after node(s) [0] had finished"
    assert [p.returncode for p in procs] == [7, 7], outs
    assert all(why in out for out in outs), outs


@pytest.mark.slow  # 25-35 s: a heartbeat timeout and three generations
def test_a_launcher_replaced_while_frozen_leaves_when_it_wakes(tmp_path):
    """Node 1's launcher freezes (SIGSTOP); the job goes on without it; a new launcher of node 1
    joins; then the old one wakes. It must stop its ranks and leave with EXIT_REPLACED, not run
    a second set of node 1's ranks in the next generation; the job finishes with the new one."""
    port, secret = free_port(), new_secret()
    rank = "import os, time; time.sleep(60 if os.environ['COMMRT_ELASTIC_GENERATION'] in ('0', '1') else 2)"
    env = {**os.environ, "PYTHONPATH": ROOT, "COMMRT_JOB_SECRET": secret}
    logs = [tmp_path / f"node{i}.log" for i in range(3)]

    def launch(node: int, log) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "commrt.cli", "launch", "-n", "1", "--nnodes", "1:2", "--node-rank", str(node),
               "--master-addr", "127.0.0.1", "--master-port", str(port), "--rdzv-timeout", "30", "--timeout", "120",
               "--", sys.executable, "-c", rank]
        with open(log, "w") as fh:
            return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT,
                                    preexec_fn=default_signals)

    def await_line(log, text: str) -> None:
        deadline = time.monotonic() + 60
        while text not in log.read_text():
            assert time.monotonic() < deadline, f"no {text!r} in {log.name}:\n{log.read_text()}"
            time.sleep(0.1)

    procs = [launch(0, logs[0]), launch(1, logs[1])]
    try:
        await_line(logs[0], "generation 0: nodes [0, 1]")
        os.kill(procs[1].pid, signal.SIGSTOP)
        await_line(logs[0], "generation 1: nodes [0]")
        procs.append(launch(1, logs[2]))
        await_line(logs[0], "generation 2: nodes [0, 1]")
        os.kill(procs[1].pid, signal.SIGCONT)
        codes = [p.wait(90) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
                p.wait(10)
    outs = [log.read_text() for log in logs]
    assert codes == [0, 5, 0], outs
    assert "replaced: launcher start 2 of node 1 joined while this one (start 1)" in outs[1], outs[1]
    assert "generation 2" not in outs[1], outs[1]
