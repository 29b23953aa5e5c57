"""Workers that join a running parameter-server job (issue 33 item 3), with real server and
worker processes on loopback and two shards: a worker started after the others have done N
steps, and a worker killed and started again with the same rank. Every wait has a deadline."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from commrt.launch import server_env
from commrt.transport.security import SECRET_ENV, new_secret
from tests.multirank.harness import ROOT
from tests.multirank.programs.ps_job import batch, grads_of, make_params
from tests.multirank.test_ps import _start_server, _stop_servers

WAIT_S = 90  # generous: a loaded 2-core machine must not turn a pass into a failure
pytestmark = pytest.mark.timeout(300)  # five processes start one after another (torch imports)


def _env(tmp_path, mode: str, **ps) -> dict:
    env = {**os.environ, "PYTHONPATH": ROOT, SECRET_ENV: new_secret(), "HOME": str(tmp_path),
           "COMMRT_PS_MODE": mode, "COMMRT_PS_OPTIMIZER": "sgd", "COMMRT_PS_LR": "0.1",
           "COMMRT_PS_MOMENTUM": "0.9", "COMMRT_PS_MAX_SEGMENT_BYTES": "128", "COMMRT_PS_TIMEOUT_S": "30",
           **{f"COMMRT_PS_{k.upper()}": str(v) for k, v in ps.items()}}
    return server_env(2, 3, env)


def _worker(env: dict, out, rank: int, steps: int, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.multirank.programs.ps_join", str(out), str(steps), *args],
                            env={**env, "RANK": str(rank)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=ROOT)


def _wait_files(*paths) -> None:
    deadline = time.monotonic() + WAIT_S
    while not all(os.path.exists(p) for p in paths):
        assert time.monotonic() < deadline, f"waited {WAIT_S}s for {[str(p) for p in paths]}"
        time.sleep(0.02)


def _finish(procs: list[subprocess.Popen]) -> str:
    """Wait for every worker; once one fails (or the deadline passes) the others are killed,
    as they would only wait for it."""
    deadline = time.monotonic() + 2 * WAIT_S
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.05)
    return "\n".join(f"--- worker process {i} (exit {p.returncode})\n{p.communicate()[0]}"
                     for i, p in enumerate(procs))


def _load(path) -> np.ndarray:
    return np.load(path, allow_pickle=False)


def _replay(turns: list[tuple[int, int]], joined_at: int) -> tuple[np.ndarray, np.ndarray]:
    """One process replays the turns: each worker's gradient at the weights it last pulled (right
    after its own push), one SGD step per push; the late worker pulls after ``joined_at`` turns.
    Returns (the weights at its join, the final weights)."""
    server = {k: v.clone().requires_grad_(True) for k, v in make_params().items()}
    opt = torch.optim.SGD(server.values(), lr=0.1, momentum=0.9)
    snap = lambda: {k: v.detach().clone() for k, v in server.items()}  # noqa: E731
    local, at_join = {0: snap(), 1: snap()}, None
    for i, (w, step) in enumerate(turns):
        if i == joined_at:  # workers 0 and 1 pulled while paused, worker 2 at its join
            local = {v: snap() for v in (0, 1, 2)}
            at_join = local[2]
        for k, g in grads_of(local[w], *batch(w, step)).items():
            server[k].grad = g
        opt.step()
        local[w] = snap()
    return (np.concatenate([v.numpy().ravel() for v in at_join.values()]),
            np.concatenate([v.numpy().ravel() for v in snap().values()]))


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_a_worker_started_after_n_steps_joins_at_the_running_step_with_the_current_weights(tmp_path, mode):
    """Workers 0 and 1 start (initial_workers = 2) and take turns for N steps, then pause; only
    then is worker 2's process started. It must start at step N with exactly the servers'
    weights (what workers 0 and 1 pull while paused, and what one process computes for those 2N
    pushes); then all three take turns to the end, which must equal the single-process replay."""
    steps, n = 8, 3
    env = _env(tmp_path, mode, initial_workers=2, staleness=1)
    servers = [_start_server(env, i) for i in range(2)]
    procs = []
    try:
        turns = ("--turns", str(n), "--pause-at", str(n), "--pausers", "0,1", "--pause-until", "joined")
        procs = [_worker(env, tmp_path, w, steps, *turns) for w in (0, 1)]
        _wait_files(tmp_path / "paused-0.npy", tmp_path / "paused-1.npy")
        assert not (tmp_path / "start-2.json").exists()
        procs.append(_worker(env, tmp_path, 2, steps, "--turns", str(n), "--announce", "joined"))
        out = _finish(procs)
    finally:
        logs = _stop_servers(servers)
    assert all(p.returncode == 0 for p in procs) and "CAUGHT" not in out, out + logs
    assert "worker 2 starts at step 3" in out and "worker 2 joins at step 3" in logs, out + logs
    order = [(w, t) for t in range(steps) for w in ((0, 1) if t < n else (0, 1, 2))]
    at_join, final = _replay(order, joined_at=2 * n)
    start = _load(tmp_path / "start-2.npy")
    assert np.array_equal(start, _load(tmp_path / "paused-0.npy")), "not the servers' current weights"
    assert np.array_equal(start, _load(tmp_path / "paused-1.npy"))
    np.testing.assert_allclose(start, at_join, rtol=0, atol=1e-6)
    assert not np.allclose(start, np.concatenate([v.numpy().ravel() for v in make_params().values()]))
    np.testing.assert_allclose(_load(tmp_path / "final-2.npy"), final, rtol=0, atol=1e-5)
    joined = json.loads((tmp_path / "start-2.json").read_text())
    assert [s["version"] for s in joined] == [2 * n, 2 * n], joined  # what the servers had applied
    for s in json.loads((tmp_path / "stats-2.json").read_text()):  # every push applied once
        assert s["version"] == len(order) and s["clocks"] == [steps] * 3 and s["rejected"] == 0, s
        if mode == "ssp":
            assert max(int(g) for g in s["staleness"]) <= 1, s


# ~10 s each. SSP's rejoin at the running step is the late join's path (the test above, by
# default), and sync drops and re-admits a worker as SSP does: both run under -m slow
@pytest.mark.parametrize("mode", ["async", *(pytest.param(m, marks=pytest.mark.slow) for m in ("ssp", "sync"))])
def test_a_killed_worker_started_again_with_its_rank_rejoins(tmp_path, mode):
    """Worker 2 SIGKILLs itself after step K; workers 0 and 1 run on (SSP and sync: once the
    shards dropped it) to step P and pause; worker 2 is started again. async: a member still,
    it resumes at its own step K+1; SSP: dropped, it joins at the running step P; both with the
    servers' current weights. sync: its init is refused, saying why, and the others finish."""
    steps, kill, pause = 14, 2, 8
    env = _env(tmp_path, mode, staleness=1, worker_timeout_s=4, on_worker_loss="continue")
    servers = [_start_server(env, i) for i in range(2)]
    procs = []
    try:
        pausing = ("--pause-at", str(pause), "--pausers", "0,1", "--pause-until", "rejoined",
                   "--start-when", "0,1,2")
        procs = [_worker(env, tmp_path, w, steps, *pausing) for w in (0, 1)]
        first = _worker(env, tmp_path, 2, steps, "--kill-at", str(kill), "--start-when", "0,1,2")
        assert first.wait(WAIT_S) == -signal.SIGKILL, first.communicate()[0]
        _wait_files(tmp_path / "paused-0.npy", tmp_path / "paused-1.npy")
        again = _worker(env, tmp_path, 2, steps, "--announce", "rejoined")
        if mode == "sync":
            assert again.wait(WAIT_S) == 0
            (tmp_path / "rejoined").touch()
        procs.append(again)
        out = _finish(procs)
    finally:
        logs = _stop_servers(servers)
    assert all(p.returncode == 0 for p in procs), out + logs
    if mode == "sync":
        caught = re.findall(r"CAUGHT (\w+): (.*)", out)
        assert len(caught) == 1 and caught[0][0] == "RequestRejected", out
        assert re.search(r"server \d rejected ps.init", caught[0][1]) and "worker 2 was dropped" in caught[0][1]
        assert "a sync job admits no worker after it began" in caught[0][1], out
        assert (tmp_path / "final-0.npy").exists() and (tmp_path / "final-1.npy").exists()
        return
    assert "CAUGHT" not in out, out + logs
    start = {"async": kill + 1, "ssp": pause}[mode]
    assert f"worker 2 starts at step {start}" in out, out + logs
    assert np.array_equal(_load(tmp_path / "start-2.npy"), _load(tmp_path / "paused-0.npy")), \
        "the rejoined worker did not get the servers' current weights"
    # the last of the workers to ask saw every push
    last = max((json.loads((tmp_path / f"stats-{w}.json").read_text()) for w in range(3)),
               key=lambda stats: sum(s["version"] for s in stats))
    for s in last:
        # every push applied once: 14 of workers 0 and 1, worker 2's first life and its second
        assert s["version"] == 2 * steps + (kill + 1) + (steps - start), s
        assert s["clocks"] == [steps] * 3 and s["dropped"] == [] and s["rejected"] == 0, s
        if mode == "ssp":
            assert max(int(g) for g in s["staleness"]) <= 1, s
