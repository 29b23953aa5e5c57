"""Replica fault tolerance at each point of a step (issue 33 item 2): 3 replicas on loopback, one
SIGKILLed or SIGSTOPped (then continued) while its gradient buckets go out, after its
all-reduce before its vote, after the vote committed before its optimizer step, or, as the
source, during the state transfer to a rejoining replica. Checks: every process ends within its
deadline with 0, no step is lost or applied twice, every replica's history agrees, and every
final parameter equals the single-process replay of the membership per step.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from commrt.launch import free_port
from commrt.runtime.config import load_config
from commrt.train.replica_ft import serve
from tests.multirank import test_replica_ft as base
from tests.multirank.harness import ROOT

FAULT_AT, DEADLINE_S = 8, 150.0
pytestmark = pytest.mark.slow  # 15-45 s each on this host; test_replica_ft.py is the default run's case


def _await_file(path: str, procs: list, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout_s}s"
        assert all(p.poll() in (None, 0, -9) for p in procs), f"a replica failed: {[p.poll() for p in procs]}"
        time.sleep(0.05)


@contextlib.contextmanager
def _job(tmp_path, others: list = ()):
    """(port, out, procs) of a job: the replicas' store served on ``port``, each replica's output
    prefix, and the list the test puts its processes in (``others``: processes it took out of
    it). On the way out, however the test left, a process still stopped is continued (it then
    ends by itself) and the store closed."""
    port = free_port()
    transport, server = serve(load_config(), "127.0.0.1", port)
    procs: list = []
    try:
        yield port, [str(tmp_path / f"r{r}") for r in range(base.REPLICAS)], procs
    finally:
        for p in (*procs, *others):
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
        server.close()
        transport.close()


def _await_full(progress: str, procs: list) -> None:
    """Until a step after the fault was taken by all 3 replicas (replica_ft_job --progress)."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        lines = open(progress).read().split("\n") if os.path.exists(progress) else []
        if any(int(f[0]) > FAULT_AT and f[2] == str(base.REPLICAS) for f in (x.split() for x in lines[:-1])):
            return
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "the job did not get back to 3"
        time.sleep(0.1)


def _check(out: list[str], width: int = 64) -> list:
    runs = [json.load(open(o + ".json")) for o in out]
    full = max(runs, key=lambda r: len(r["history"]))
    history = full["history"]
    assert [s for s, _ in history] == list(range(base.STEPS)), f"a step was lost or applied twice: {history}"
    for r, run in enumerate(runs):
        # a replica left out (frozen) skips the steps it missed: its state came from a live one
        assert all(history[s] == [s, c] for s, c in run["history"]), f"replica {r}'s history disagrees: {run}"
    ref = base.reference(history, width)
    for r, o in enumerate(out):
        got = torch.load(o + ".pt")
        for k, v in ref.items():
            torch.testing.assert_close(got[k], v, atol=1e-5, rtol=1e-5, msg=lambda m: f"replica {r}, {k}: {m}")
    return history


@pytest.mark.parametrize("where", ["all_reduce", "vote", "apply"])
def test_a_replica_killed_at_each_point_of_a_step(tmp_path, where):
    with _job(tmp_path) as (port, out, procs):
        width = ["--width", "600"]  # two gradient buckets: the first is in flight when the victim dies
        procs[:] = [base._spawn(port, r, out[r], *width, *(["--fault", f"kill:{where}:{FAULT_AT}"] if r == 1 else []))
                    for r in range(base.REPLICAS)]
        procs[1].wait(timeout=DEADLINE_S)
        assert procs[1].returncode == -9, "the victim should have died by SIGKILL"
        procs[1] = base._spawn(port, 1, out[1], *width)
        base._wait_all(procs, DEADLINE_S)
    assert [p.returncode for p in procs] == [0, 0, 0]
    history = _check(out, 600)
    survivors = [FAULT_AT + (where == "apply"), [0, 2]]
    assert survivors in history, f"the step after the kill should be averaged over the survivors: {history}"
    assert history[-1][1] == [0, 1, 2]


@pytest.mark.parametrize("where", ["all_reduce", "vote", "apply"])
def test_a_replica_frozen_at_a_point_of_a_step_comes_back_by_itself(tmp_path, where):
    with _job(tmp_path) as (port, out, procs):
        width = ["--width", "600"]
        procs[:] = [base._spawn(port, r, out[r], *width, *(["--fault", f"stop:{where}:{FAULT_AT}"] if r == 1 else []))
                    for r in range(base.REPLICAS)]
        _await_file(out[1] + ".fault", procs, DEADLINE_S)
        time.sleep(8.0)  # longer than the vote timeout and the heartbeat bound: the others go on
        os.kill(procs[1].pid, signal.SIGCONT)
        base._wait_all(procs, DEADLINE_S)
    assert [p.returncode for p in procs] == [0, 0, 0]
    history = _check(out, 600)
    assert [FAULT_AT + (where == "apply"), [0, 2]] in history  # after the commit, the next step goes without it
    assert history[-1][1] == [0, 1, 2]


def test_the_source_killed_during_a_state_transfer(tmp_path):
    """Replica 2 dies and restarts; replica 0, the source of its state, dies while sending it;
    replica 1 goes on and hands the state to both when they come back."""
    with _job(tmp_path) as (port, out, procs):
        procs[:] = [base._spawn(port, 0, out[0], "--fault", f"kill:sync:{FAULT_AT}"),
                    base._spawn(port, 1, out[1]),
                    base._spawn(port, 2, out[2], "--die-at", str(FAULT_AT))]
        procs[2].wait(timeout=DEADLINE_S)
        procs[2] = base._spawn(port, 2, out[2])
        procs[0].wait(timeout=DEADLINE_S)
        assert procs[0].returncode == -9 and os.path.exists(out[0] + ".fault")
        procs[0] = base._spawn(port, 0, out[0])
        base._wait_all(procs, DEADLINE_S)
    assert [p.returncode for p in procs] == [0, 0, 0]
    history = _check(out)
    assert history[-1][1] == [0, 1, 2]


def test_a_frozen_replica_restarted_elsewhere_is_refused_when_it_wakes(tmp_path):
    """Replica 1 freezes; a new process takes its place (its supervisor thought it dead) and
    rejoins; then the old one wakes. The old incarnation must leave with an error, not take
    part (two processes as one replica), and the job finish with the new one."""
    old, stale = str(tmp_path / "r1-old"), []
    with _job(tmp_path, stale) as (port, out, procs):
        procs[:] = [base._spawn(port, 0, out[0], "--progress"), base._spawn(port, 1, old, "--fault", f"stop:vote:{FAULT_AT}"),
                    base._spawn(port, 2, out[2])]
        _await_file(old + ".fault", procs, DEADLINE_S)
        stale.append(procs[1])
        procs[1] = base._spawn(port, 1, out[1])
        _await_full(out[0] + ".progress", procs)  # the new one has rejoined
        os.kill(stale[0].pid, signal.SIGCONT)
        base._wait_all([*procs, *stale], DEADLINE_S)
    assert [p.returncode for p in procs] == [0, 0, 0]
    assert stale[0].returncode not in (0, None, -9)
    _check(out)


def test_the_source_frozen_during_a_state_transfer_comes_back_by_itself(tmp_path):
    """As above, but replica 0 freezes while sending the state (SIGSTOP), and is continued 8 s later."""
    with _job(tmp_path) as (port, out, procs):
        procs[:] = [base._spawn(port, 0, out[0], "--fault", f"stop:sync:{FAULT_AT}"),
                    base._spawn(port, 1, out[1]),
                    base._spawn(port, 2, out[2], "--die-at", str(FAULT_AT))]
        procs[2].wait(timeout=DEADLINE_S)
        procs[2] = base._spawn(port, 2, out[2])
        _await_file(out[0] + ".fault", procs, DEADLINE_S)
        time.sleep(8.0)
        os.kill(procs[0].pid, signal.SIGCONT)
        base._wait_all(procs, DEADLINE_S)
    assert [p.returncode for p in procs] == [0, 0, 0]
    history = _check(out)
    assert history[-1][1] == [0, 1, 2]


def test_the_leader_killed_while_it_forms_the_next_generation(tmp_path):
    """Replica 2 dies; the survivors' leader of generation 1 dies before writing the plan (a
    second failure). The last survivor must go on alone (it used to wait for the plan, then end
    with RendezvousError), and both come back."""
    with _job(tmp_path) as (port, out, procs):
        # slower alone (1 s a step): the restarted two must find the survivor still running
        slow = ["--pause", "0.2", "--progress"]
        procs[:] = [base._spawn(port, 0, out[0], *slow, "--fault", "kill:lead:1"), base._spawn(port, 1, out[1], *slow,
                    "--fault", "kill:lead:1"), base._spawn(port, 2, out[2], "--die-at", str(FAULT_AT))]
        procs[2].wait(timeout=DEADLINE_S)
        deadline = time.monotonic() + DEADLINE_S
        while procs[0].poll() is None and procs[1].poll() is None:
            assert time.monotonic() < deadline, "no leader died"
            time.sleep(0.05)
        leader = 0 if procs[0].poll() is not None else 1
        assert procs[leader].returncode == -9 and os.path.exists(out[leader] + ".fault")
        gate = str(tmp_path / "rejoin")  # started now, they rejoin once the survivor has gone on alone
        procs[2], procs[leader] = (base._spawn(port, 2, out[2], "--wait-for", gate),
                                   base._spawn(port, leader, out[leader], "--wait-for", gate))
        _await_alone(out[1 - leader] + ".progress", procs[1 - leader])
        open(gate, "w").close()
        base._wait_all(procs, DEADLINE_S)
    assert [p.returncode for p in procs] == [0, 0, 0]
    history = _check(out)
    assert [FAULT_AT, [1 - leader]] in history and history[-1][1] == [0, 1, 2], history


def _await_alone(progress: str, proc) -> None:
    """Until the survivor has applied a step alone (replica_ft_job --progress). (A fixed 20 s
    wait, then starting the two: on a loaded host the survivor finished before their imports
    were done, and they were refused.)"""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        lines = open(progress).read().split("\n")[:-1] if os.path.exists(progress) else []
        if any(line.split()[2] == "1" for line in lines):
            return
        assert time.monotonic() < deadline and proc.poll() is None, "the survivor did not go on alone"
        time.sleep(0.1)


def test_a_replica_killed_before_the_first_generation_opens(tmp_path):
    """Replica 2 registers for generation 0 and dies before opening its world: the first
    generation fails to form on the others. Replica 0, its source, still holds the job's first
    state and must lead the next generation (it registered as a replica without state, like the
    others, so nobody led and both survivors ended with RendezvousError); replica 1, whose state
    the first sync never fixed, receives it; the restarted replica 2 rejoins."""
    with _job(tmp_path) as (port, out, procs):
        procs[:] = [base._spawn(port, r, out[r], *(["--fault", "kill:open:0"] if r == 2 else []))
                    for r in range(base.REPLICAS)]
        procs[2].wait(timeout=DEADLINE_S)
        assert procs[2].returncode == -9 and os.path.exists(out[2] + ".fault")
        procs[2] = base._spawn(port, 2, out[2])
        base._wait_all(procs, DEADLINE_S)
    assert [p.returncode for p in procs] == [0, 0, 0]
    history = _check(out)
    assert history[-1][1] == [0, 1, 2]


def test_a_replica_restarted_with_another_model_is_refused_and_the_others_go_on(tmp_path):
    """Replica 2 dies and is restarted with a model of another width (a wrong config on that
    node). Its state transfer cannot succeed: it must leave with a ConfigError naming the
    mismatch, and the others go on without it. (The transfer's mismatch was taken for a fault:
    every generation with it failed while forming, the joiner registered again, and the job
    never took another step.)"""
    with _job(tmp_path) as (port, out, procs):
        procs[:] = [base._spawn(port, r, out[r], *(["--die-at", str(FAULT_AT)] if r == 2 else []))
                    for r in range(base.REPLICAS)]
        procs[2].wait(timeout=DEADLINE_S)
        with open(out[2] + ".err", "w") as err:
            procs[2] = base._spawn(port, 2, out[2], "--width", "32", stderr=err)
        base._wait_all(procs, 90)
    assert [p.returncode for p in procs[:2]] == [0, 0] and procs[2].returncode not in (0, -9)
    assert "ConfigError" in open(out[2] + ".err").read()
    runs = [json.load(open(o + ".json")) for o in out[:2]]
    history = runs[0]["history"]
    assert runs[1]["history"] == history and [s for s, _ in history] == list(range(base.STEPS))
    assert all(c == [0, 1] for s, c in history if s >= FAULT_AT)
    ref = base.reference(history)
    for r, o in enumerate(out[:2]):
        got = torch.load(o + ".pt")
        for k, v in ref.items():
            torch.testing.assert_close(got[k], v, atol=1e-5, rtol=1e-5, msg=lambda m: f"replica {r}, {k}: {m}")


def test_a_replica_started_for_a_larger_job_is_refused_and_the_others_go_on(tmp_path):
    """A fourth replica started with 4 replicas (an attempt to grow the job) beside three
    started with 3: the leaders read the registrations of replicas 0-2 only, so it was left out
    of every generation, and each time it came back it ended the running one: the job never
    took another step. It must leave with a ConfigError naming both counts."""
    with _job(tmp_path) as (port, out, procs):
        slow = ["--pause", "0.5"]  # 30 s: the fourth comes while they run
        procs[:] = [base._spawn(port, r, out[r], *slow, *(["--progress"] if r == 0 else [])) for r in range(base.REPLICAS)]
        deadline = time.monotonic() + DEADLINE_S
        while not os.path.exists(out[0] + ".progress"):  # the job is running
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.1)
        extra = str(tmp_path / "r3")
        with open(extra + ".err", "w") as err:
            procs.append(subprocess.Popen([sys.executable, "-m", "tests.multirank.programs.replica_ft_job", "3", "4",
                                           f"127.0.0.1:{port}", str(base.STEPS), extra, "--pause", str(base.PAUSE_S)],
                                          cwd=ROOT, stderr=err, env={**os.environ, "PYTHONPATH": ROOT}))
        base._wait_all(procs, 90)
    assert [p.returncode for p in procs[:3]] == [0, 0, 0] and procs[3].returncode not in (0, -9)
    assert "ConfigError" in open(extra + ".err").read()
    _check(out)


def test_a_replica_restarted_after_the_job_finished_learns_it_at_once(tmp_path):
    """The 3 replicas finish the job (each calls ReplicaFT.close()), then replica 0 is started
    again against the still running store. Nobody will write a plan any more: it must leave at
    once with a JobFinished naming the step, not register and wait out join_timeout_s (60 s)
    for a plan that never comes, then fail with 'the plan of generation N still missing'."""
    with _job(tmp_path) as (port, out, procs):
        procs[:] = [base._spawn(port, r, out[r]) for r in range(base.REPLICAS)]
        base._wait_all(procs, DEADLINE_S)
        assert [p.returncode for p in procs] == [0, 0, 0]
        late = str(tmp_path / "late")
        with open(late + ".err", "w") as err:
            procs.append(base._spawn(port, 0, late, stderr=err))
            try:  # a deadline far below join_timeout_s (60 s), room for a loaded host's start-up
                procs[-1].wait(timeout=30)
            except subprocess.TimeoutExpired:
                procs[-1].kill()
                procs[-1].wait()
                pytest.fail("the restarted replica was still waiting 30 s after the job had finished")
    text = open(late + ".err").read()
    assert procs[-1].returncode not in (0, -9), text
    assert "JobFinished" in text and f"finished at step {base.STEPS}" in text, text
    assert not os.path.exists(late + ".json")
    _check(out)
