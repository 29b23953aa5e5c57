"""Replica fault tolerance on the emulated cluster (issue 33 item 4): 3 nodes, one replica each,
in network namespaces (commrt/emulate.py); the store on a fourth node, the launcher's place.
A node dies at a random step (seeded by $COMMRT_TEST_SEED, printed): its link is cut
(``ip link set down``) and its rank SIGKILLed while it stands after the step's backward, before
the average, so the survivors learn of it only by heartbeats (no FIN or RST crosses a downed link).
Then the link comes up and the rank is started again.

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
from commrt.runtime.errors import ConfigError
from commrt.transport.security import new_secret
from tests.multirank.harness import ROOT, default_signals
from tests.multirank.test_replica_ft import reference

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

    def replica(self, r: int, *extra: str) -> subprocess.Popen:
        out = str(self.dir / f"r{r}")
        return self.spawn(r, ["-m", "tests.multirank.programs.replica_ft_job", str(r), str(REPLICAS), self.store,
                              str(STEPS), out, "--pause", str(PAUSE_S), "--progress", *extra], f"replica{r}")

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
        if any(p.poll() not in (None, 0) for p in nodes.procs):
            break
        time.sleep(0.05)
    raise AssertionError(f"no {what} within {timeout_s}s\n{nodes.output()}")


@contextlib.contextmanager
def _cluster(nnodes: int):
    try:
        emulate.check_usable(emulate.parse_shape("1gbit"))
    except ConfigError as exc:
        pytest.skip(str(exc))
    with emulate.cluster(nnodes, emulate.parse_shape("1gbit")) as net:
        yield net
    tag = net.namespaces[0].rsplit("-", 1)[0]
    assert not [ns for ns in emulate._namespaces() if ns.startswith(tag)], "namespaces left behind"


@pytest.mark.timeout(300)
def test_a_node_dies_at_a_random_step_and_rejoins(tmp_path):
    seed, victim, die_at = _pick()
    print(f"\nCOMMRT_TEST_SEED={seed}: node {victim} dies at step {die_at} (link down, then SIGKILL)")
    survivors = [r for r in range(REPLICAS) if r != victim]
    with _cluster(REPLICAS + 1) as net:
        nodes = Nodes(net, tmp_path)
        try:
            nodes.start_store()
            procs = [nodes.replica(r, *(["--freeze-at", str(die_at)] if r == victim else [])) for r in range(REPLICAS)]
            _wait_file(nodes, tmp_path / f"r{victim}.frozen", f"node {victim} at step {die_at}")
            nodes.link(victim, "down")  # first: the kernel's FIN/RST for the killed process must not get out
            t_kill = time.time()
            procs[victim].kill()
            assert procs[victim].wait(10) == -signal.SIGKILL
            # the survivors complete the step the node died in, then the node comes back
            _wait_file(nodes, tmp_path / f"r{survivors[0]}.progress", f"step {die_at} on the survivors",
                       lambda text: any(int(line.split()[0]) >= die_at for line in text.splitlines()))
            nodes.link(victim, "up")
            t_restart = time.time()
            procs[victim] = nodes.replica(victim)
            end = time.monotonic() + DEADLINE_S
            for p in procs:
                p.wait(timeout=max(end - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"a replica hung past {DEADLINE_S}s\n{nodes.output()}") from None
        finally:
            nodes.kill_all()
    assert [p.returncode for p in procs] == [0] * REPLICAS, nodes.output()
    _check(tmp_path, victim, survivors, die_at, t_kill, t_restart)


def _check(tmp_path, victim: int, survivors: list[int], die_at: int, t_kill: float, t_restart: float) -> None:
    runs = {r: json.load(open(tmp_path / f"r{r}.json")) for r in range(REPLICAS)}
    history = runs[survivors[0]]["history"]
    assert [s for s, _ in history] == list(range(STEPS)), "a step was lost or applied twice"
    assert runs[survivors[1]]["history"] == history
    assert all(c == list(range(REPLICAS)) for _, c in history[:die_at])
    assert history[die_at] == [die_at, survivors], "the step the node died in is averaged over the survivors"
    joined = runs[victim]["joined_at"]
    assert all(c == list(range(REPLICAS)) for s, c in history if s >= joined), "back to full size once joined"
    assert all(c == survivors for s, c in history if die_at <= s < joined)
    assert runs[victim]["history"] == [h for h in history if h[0] >= joined - 1]
    ref = reference(history)
    for r in range(REPLICAS):
        got = torch.load(tmp_path / f"r{r}.pt")
        for k, v in ref.items():
            torch.testing.assert_close(got[k], v, atol=1e-5, rtol=1e-5, msg=lambda m: f"replica {r}, {k}: {m}")
    counts = runs[survivors[0]]["counts"]
    assert counts["drops"] == 1 and counts["rejoins"] == 1 and counts["members"] == list(range(REPLICAS)), counts
    recovered = runs[survivors[0]]["times"][str(die_at)][0] - t_kill
    full = runs[survivors[0]]["times"][str(joined)][0] - t_restart
    print(f"kill -> next completed step {recovered:.2f}s (heartbeats over a downed link); restart -> full size "
          f"{full:.2f}s (the restarted process's start included; it joined at step {joined})")
    assert recovered < 15 and full < 30
