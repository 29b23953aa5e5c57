"""Replica fault tolerance on the emulated cluster (issue 33 items 2 and 4): 3 nodes in network
namespaces (commrt/emulate.py), the store on a fourth node, the launcher's place. A replica is a
node: one rank (data parallel), or a group of 2 ranks sharding the gradient and the optimizer
state inside the node (HYBRID_SHARD's layout, replica_group.py). A node dies at a random step
(seeded by $COMMRT_TEST_SEED, printed): its link is cut (``ip link set down``) and all its ranks
SIGKILLed while they stand after the step's backward, before the average, so the survivors learn
of it only by heartbeats (no FIN or RST crosses a downed link). Then the link comes up and the
node's ranks are started again.

Checks: nothing hangs (every process and wait has a deadline), the survivors finish the step the
node died in among themselves and go on, no step is lost or applied twice, the node rejoins and
the job is back to 3, and every replica's final parameters equal the single-process replay of
the membership per step (tests/multirank/test_replica_ft.py's reference) within 1e-5. The times
from the kill to the survivors' next completed step and from the restart to full size are
printed. Namespaces and processes are removed on every exit path.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import select
import signal
import subprocess
import sys
import time

import pytest
import torch

from commrt import emulate
from commrt.transport.security import new_secret
from tests.multirank.harness import ROOT, default_signals, emulated_cluster
from tests.multirank.programs import replica_ft_job as job

REPLICAS, STEPS, PAUSE_S, PORT = 3, 60, 0.1, 29400
STORE_NODE = REPLICAS  # a node of its own: the store outlives any replica's node
DEADLINE_S = 150.0


def _pick() -> tuple[int, int, int]:
    seed = int(os.environ.get("COMMRT_TEST_SEED", str(random.SystemRandom().randrange(1 << 16))))
    rng = random.Random(seed)
    return seed, rng.randrange(REPLICAS), rng.randint(5, 20)


class Nodes:
    """The store and the replicas' processes, each in its node's namespace, each with a log file."""

    def __init__(self, net, tmp_path):
        self.net, self.dir, self.procs, self.logs = net, tmp_path, [], []
        self.killed: set[int] = set()  # pids this test SIGKILLed on purpose
        self.env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                    "COMMRT_COMM_BACKEND": "zmq", "COMMRT_JOB_SECRET": new_secret(), "PYTHONUNBUFFERED": "1"}
        self.store = f"{emulate.node_address(STORE_NODE)}:{PORT}"

    def spawn(self, node: int, argv: list[str], name: str, stdout=None) -> subprocess.Popen:
        prefix, extra = self.net.wrap(node)
        log = self.dir / f"{name}.{len(self.logs)}.log"
        self.logs.append(log)
        with open(log, "w") as fh:
            p = subprocess.Popen([*prefix, sys.executable, *argv], env={**self.env, **extra}, cwd=ROOT,
                                 stdout=stdout or fh, stderr=fh, text=True, start_new_session=True,
                                 preexec_fn=default_signals)
        self.procs.append(p)
        return p

    def start_store(self) -> None:
        p = self.spawn(STORE_NODE, ["-m", "tests.multirank.programs.replica_ft_store", *self.store.split(":"),
                                    str(DEADLINE_S + 60)], "store", stdout=subprocess.PIPE)
        ready, _, _ = select.select([p.stdout], [], [], 60)
        assert ready and p.stdout.readline().strip() == "READY", f"the store did not start\n{self.output()}"

    def node(self, r: int, shards: int, *extra: str) -> list[subprocess.Popen]:
        """Replica ``r``'s ranks, on node ``r``."""
        return [self.spawn(r, ["-m", "tests.multirank.programs.replica_ft_job", str(r), str(REPLICAS), self.store,
                               str(STEPS), str(self.dir / f"r{r}s{s}"), "--pause", str(PAUSE_S), "--progress",
                               "--shard", str(s), "--shards", str(shards), *extra], f"replica{r}s{s}")
                for s in range(shards)]

    def link(self, node: int, state: str) -> None:
        subprocess.run(["ip", "-n", self.net.namespaces[node], "link", "set", "eth0", state], check=True, timeout=30)

    def output(self, tail: int = 3000) -> str:
        return "\n".join(f"--- {log.name} ---\n{log.read_text()[-tail:]}" for log in self.logs if log.exists())

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)


def _wait_file(nodes: Nodes, path, what: str, check=lambda text: True, timeout_s: float = 120.0) -> str:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if path.exists() and check(path.read_text()):
            return path.read_text()
        if any(p.poll() not in (None, 0) and p.pid not in nodes.killed for p in nodes.procs):
            break
        time.sleep(0.05)
    raise AssertionError(f"no {what} within {timeout_s}s\n{nodes.output()}")


@contextlib.contextmanager
def _cluster(nnodes: int):
    """The harness's 1 Gbit cluster, and afterwards none of its namespaces left."""
    with emulated_cluster(nnodes) as net:
        yield net
    tag = net.namespaces[0].rsplit("-", 1)[0]
    assert not [ns for ns in emulate._namespaces() if ns.startswith(tag)], "namespaces left behind"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("shards", [1, pytest.param(2, id="groups_of_2", marks=pytest.mark.slow)])  # 48 s here
def test_a_node_dies_at_a_random_step_and_rejoins(tmp_path, shards):
    seed, victim, die_at = _pick()
    print(f"\nCOMMRT_TEST_SEED={seed}: node {victim} ({shards} rank(s)) dies at step {die_at} (link down, then SIGKILL)")
    survivors = [r for r in range(REPLICAS) if r != victim]
    with _cluster(REPLICAS + 1) as net:
        nodes = Nodes(net, tmp_path)
        try:
            nodes.start_store()
            procs = [nodes.node(r, shards, *(["--freeze-at", str(die_at)] if r == victim else []))
                     for r in range(REPLICAS)]
            for s in range(shards):
                _wait_file(nodes, tmp_path / f"r{victim}s{s}.frozen", f"node {victim}'s rank {s} at step {die_at}")
            nodes.link(victim, "down")  # first: the kernel's FIN/RST for the killed processes must not get out
            t_kill = time.time()
            for p in procs[victim]:
                nodes.killed.add(p.pid)
                p.kill()
            assert [p.wait(10) for p in procs[victim]] == [-signal.SIGKILL] * shards
            # the survivors complete the step the node died in, then the node comes back
            _wait_file(nodes, tmp_path / f"r{survivors[0]}s0.progress", f"step {die_at} on the survivors",
                       lambda text: any(int(line.split()[0]) >= die_at for line in text.splitlines()))
            nodes.link(victim, "up")
            t_restart = time.time()
            procs[victim] = nodes.node(victim, shards)
            end = time.monotonic() + DEADLINE_S
            for p in (p for ranks in procs for p in ranks):
                p.wait(timeout=max(end - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"a replica hung past {DEADLINE_S}s\n{nodes.output()}") from None
        finally:
            nodes.kill_all()
    assert [p.returncode for ranks in procs for p in ranks] == [0] * (REPLICAS * shards), nodes.output()
    _check(tmp_path, shards, victim, survivors, die_at, t_kill, t_restart)


def reference(history: list, shards: int) -> dict:
    """One process: each step's gradient is the mean over the contributing replicas' ranks'
    gradients on their data (rank s of replica r reads batch r * shards + s)."""
    model = job.make_model()
    opt = job.make_optimizer(model)
    for step, contributors in history:
        grads = []
        for data in (r * shards + s for r in contributors for s in range(shards)):
            model.zero_grad(set_to_none=True)
            job.local_backward(model, data, step)
            grads.append([p.grad.clone() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            p.grad = sum(g[i] for g in grads) / len(grads)
        opt.step()
    return model.state_dict()


def _check(tmp_path, shards: int, victim: int, survivors: list[int], die_at: int, t_kill: float,
           t_restart: float) -> None:
    ranks = [(r, s) for r in range(REPLICAS) for s in range(shards)]
    every = {(r, s): json.load(open(tmp_path / f"r{r}s{s}.json")) for r, s in ranks}
    for (r, s), run in every.items():
        assert run["history"] == every[(r, 0)]["history"], f"replica {r}: its ranks applied different steps"
    runs = {r: every[(r, 0)] for r in range(REPLICAS)}
    history = runs[survivors[0]]["history"]
    assert [s for s, _ in history] == list(range(STEPS)), "a step was lost or applied twice"
    assert runs[survivors[1]]["history"] == history
    assert all(c == list(range(REPLICAS)) for _, c in history[:die_at])
    assert history[die_at] == [die_at, survivors], "the step the node died in is averaged over the survivors"
    joined = runs[victim]["joined_at"]
    assert all(c == list(range(REPLICAS)) for s, c in history if s >= joined), "back to full size once joined"
    assert all(c == survivors for s, c in history if die_at <= s < joined)
    assert runs[victim]["history"] == [h for h in history if h[0] >= joined - 1]
    ref = reference(history, shards)
    for r, s in ranks:
        got = torch.load(tmp_path / f"r{r}s{s}.pt")
        for k, v in ref.items():
            torch.testing.assert_close(got[k], v, atol=1e-5, rtol=1e-5, msg=lambda m: f"replica {r}.{s}, {k}: {m}")
    counts = runs[survivors[0]]["counts"]
    assert counts["drops"] == 1 and counts["rejoins"] == 1 and counts["members"] == list(range(REPLICAS)), counts
    recovered = runs[survivors[0]]["times"][str(die_at)][0] - t_kill
    full = runs[survivors[0]]["times"][str(joined)][0] - t_restart
    print(f"{shards} rank(s) per node: kill -> next completed step {recovered:.2f}s (a downed link: heartbeats, "
          f"or the vote timeout); restart -> full size "
          f"{full:.2f}s (the restarted process's start included; it joined at step {joined})")
    assert recovered < 15 and full < 30
