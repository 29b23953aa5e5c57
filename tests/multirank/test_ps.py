"""The parameter server with real server and worker processes on loopback: sync training equals
single-process training, crash-and-resume ends where an uninterrupted run ends, lost workers
and bad requests get the promised errors."""
from __future__ import annotations

import io
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
import zmq

from commrt.optim import rules as optim
from commrt.runtime.config import load_config
from commrt.launch import launch, server_env
from commrt.transport.security import DEFAULT_SECRET_FILE, SECRET_ENV, job_secret, new_secret
from tests.multirank.harness import ROOT, run_ranks
from tests.multirank.programs.ps_job import batch, loss_of, make_params

STEPS = 6


@pytest.fixture(autouse=True)
def own_secret(monkeypatch, tmp_path):
    """Every test runs with its own job secret and a home of its own, and must not create the
    per-user secret file (which other jobs of the user share)."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv(SECRET_ENV, new_secret())
    yield
    assert not os.path.exists(os.path.join(home, DEFAULT_SECRET_FILE.replace("~" + os.sep, ""))), \
        "the test wrote the per-user secret file"


def reference(kind: str, workers: int, steps: int, **hp) -> np.ndarray:
    """Single-process training on the global batch (every worker's batch for the step)."""
    params = {k: v.clone().requires_grad_(True) for k, v in make_params().items()}
    if kind == "lamb":
        spec = optim.OptimSpec("lamb", **hp)
        state = {k: optim.init_state(spec, v) for k, v in params.items()}
    else:
        opt = (torch.optim.SGD(params.values(), **hp) if kind == "sgd"
               else torch.optim.AdamW(params.values(), foreach=False, **hp))
    for step in range(steps):
        xs, ys = zip(*(batch(w, step) for w in range(workers)))
        for v in params.values():
            v.grad = None
        loss_of(params, torch.cat(xs), torch.cat(ys)).backward()
        if kind == "lamb":
            with torch.no_grad():
                for k, v in params.items():
                    optim.step_(v.data, v.grad, state[k], spec, step + 1)
        else:
            opt.step()
    return np.concatenate([v.detach().numpy().ravel() for v in params.values()])


def ps_env(kind: str, **extra) -> dict:
    hp = {"sgd": dict(COMMRT_PS_LR="0.1", COMMRT_PS_MOMENTUM="0.9"),
          "adamw": dict(COMMRT_PS_LR="0.01", COMMRT_PS_WEIGHT_DECAY="0.1"),
          "lamb": dict(COMMRT_PS_LR="0.05", COMMRT_PS_WEIGHT_DECAY="0.01")}[kind]
    return {"COMMRT_PS_OPTIMIZER": kind, "COMMRT_PS_MAX_SEGMENT_BYTES": "128", "COMMRT_PS_TIMEOUT_S": "20",
            **hp, **{f"COMMRT_PS_{k.upper()}": str(v) for k, v in extra.items()}}


REF_HP = {"sgd": dict(lr=0.1, momentum=0.9), "adamw": dict(lr=0.01, weight_decay=0.1),
          "lamb": dict(lr=0.05, weight_decay=0.01)}


def run_job(tmp_path, workers: int, servers: int, env: dict, *args: str, expect_fail=False):
    return run_ranks(workers, "ps_job", str(tmp_path), *args, env=env, servers=servers,
                     timeout_s=60, expect_fail=expect_fail)


# one optimizer's rule does not depend on the layout: adamw and lamb at 1 x 2 run under -m slow
@pytest.mark.parametrize("kind,servers,workers", [("sgd", 1, 2), *((k, 2, 3) for k in ("sgd", "adamw", "lamb")),
                                                  *(pytest.param(k, 1, 2, marks=pytest.mark.slow) for k in ("adamw", "lamb"))])
def test_sync_equals_single_process(tmp_path, kind, servers, workers):
    run_job(tmp_path, workers, servers, ps_env(kind), str(STEPS))
    ref = reference(kind, workers, STEPS, **REF_HP[kind])
    for w in range(workers):
        got = np.load(tmp_path / f"params-{w}.npy", allow_pickle=False)
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-6, err_msg=f"worker {w}")
    assert not np.allclose(ref, np.concatenate([v.numpy().ravel() for v in make_params().values()]))


def test_servers_and_workers_over_ipv6(tmp_path):
    """The launcher's servers on ::1 (its master address's loopback), tcp://[::1]:port in
    [ps] servers: sync training still equals the single-process run."""
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("this host has no IPv6 loopback (::1)")
    _, out = run_ranks(1, "ps_job", str(tmp_path), str(STEPS), env=ps_env("sgd"), servers=1, master_addr="::1",
                       timeout_s=60)  # one worker: the addresses are what is new here
    assert "listening on tcp://[::1]:" in out, out
    ref = reference("sgd", 1, STEPS, **REF_HP["sgd"])
    for w in range(1):
        np.testing.assert_allclose(np.load(tmp_path / f"params-{w}.npy", allow_pickle=False), ref, rtol=0, atol=1e-6)


def test_dead_worker_in_sync_mode_is_named(tmp_path):
    env = ps_env("sgd", worker_timeout_s=3)  # generous: a slow live worker must not be blamed
    _, out = run_job(tmp_path, 3, 2, env, "10", "--die-at", "3")
    caught = re.findall(r"CAUGHT (\w+): (.*)", out)
    assert len(caught) == 2 and all(k == "PeerLost" for k, _ in caught), out
    assert all("lost worker 2 during ps.push_pull (seq 3)" in m and "for worker(s) [2]" in m
               for _, m in caught), out
    for seconds in re.findall(r"detected after ([\d.]+)s", out):  # by the 3 s worker timeout,
        assert float(seconds) < 15, out  # not the 20 s server timeout (generous: a shared machine)


def test_dead_worker_can_be_left_behind(tmp_path):
    env = ps_env("sgd", worker_timeout_s=1, on_worker_loss="continue")
    _, out = run_job(tmp_path, 3, 1, env, "8", "--die-at", "3")
    assert "CAUGHT" not in out and "dropping worker(s) [2]" in out, out
    assert (tmp_path / "params-0.npy").exists() and (tmp_path / "params-1.npy").exists()


def test_async_keeps_serving_the_rest(tmp_path):
    env = ps_env("sgd", mode="async", worker_timeout_s=1)
    _, out = run_job(tmp_path, 2, 2, env, "12", "--die-at", "3")
    assert "CAUGHT" not in out, out
    stats = out[out.index("STATS"):]
    # worker 0 got all 12 steps through on both servers, whatever worker 1 managed before it left
    assert len(re.findall(r"'clocks': \[12, [0-3]\]", stats)) == 2, stats


@pytest.mark.parametrize("mode,extra", [("async", {}), ("ssp", {"COMMRT_PS_STALENESS": "2"})])
def test_async_and_ssp_converge_within_the_bound(mode, extra):
    env = {"COMMRT_PS_MODE": mode, "COMMRT_PS_LR": "0.05", "COMMRT_PS_MOMENTUM": "0.9",
           "COMMRT_PS_PRINT_STATS": "1", **extra}
    out = io.StringIO()
    cmd = [sys.executable, "-m", "workers.ps_train", "--steps", "150", "--log-every", "50",
           "--straggler", "2", "--delay-ms", "4"]
    result = launch(3, cmd, out=out, timeout_s=90, servers=2, env={**os.environ, **env})
    text = out.getvalue()
    assert result.returncode == 0, text[-4000:]
    finals = [float(last) for _, last in re.findall(r"loss ([\d.]+) -> ([\d.]+)", text)]
    # from ln(8) = 2.08 at the start (a late worker's first loss is already lower in async)
    assert len(finals) == 3 and sum(finals) / 3 < 1.0, text[-3000:]
    gaps = [int(g) for hist in re.findall(r"staleness (\{[^}]*\})", text)
            for g in re.findall(r"'(\d+)'", hist)]
    assert gaps, text[-3000:]
    if mode == "ssp":
        assert max(gaps) == 2, gaps  # the straggler pushes the others right up to the bound, never past


def test_kill_and_resume_ends_like_an_uninterrupted_run(tmp_path):
    steps, finals = 24, []
    for crash in (False, True):
        work = tmp_path / ("crash" if crash else "clean")
        work.mkdir()
        env = {**os.environ, **ps_env("adamw", checkpoint_dir=work / "ckpt", checkpoint_every=4),
               "PYTHONPATH": ROOT}
        env = server_env(2, 2, env)
        servers = [_start_server(env, i) for i in range(2)]
        out = io.StringIO()
        job = threading.Thread(target=lambda: out.write(str(launch(
            2, [sys.executable, "-m", "tests.multirank.programs.ps_job", str(work), str(steps),
                "--marker-at", "10", "--sleep", "0.05"], out=out, env=env, timeout_s=90).returncode)))
        job.start()
        try:
            if crash:  # once worker 0 reached step 10: past a checkpoint (every 4), mid-interval
                deadline = time.monotonic() + 60
                while not (work / "marker").exists():
                    assert time.monotonic() < deadline, "worker 0 never reached the marker step"
                    time.sleep(0.01)
                servers[1].send_signal(signal.SIGKILL)
                servers[1].wait()
                servers[1] = _start_server(env, 1, "--resume")
            job.join(90)
        finally:
            logs = _stop_servers(servers)
        assert out.getvalue().endswith("0"), out.getvalue()[-3000:] + logs
        if crash:
            resumed = re.search(r"server 1 resumed at version (\d+) \((\d+) updates replayed", logs)
            assert resumed and 0 < int(resumed.group(1)) < steps, logs
        finals.append([np.load(work / f"params-{w}.npy", allow_pickle=False) for w in range(2)])
    for clean, crashed in zip(*finals):
        assert np.array_equal(clean, crashed)


def _start_server(env: dict, index: int, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "servers.ps", "--index", str(index), *extra], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)


def _stop_servers(procs: list[subprocess.Popen]) -> str:
    logs = []
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
        try:
            logs.append(p.communicate(timeout=10)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            logs.append(p.communicate()[0])
    return "\n".join(logs)


def _connect_when_listening(host: str, port: int, within_s: float = 20.0) -> socket.socket:
    deadline = time.monotonic() + within_s
    while True:
        try:
            return socket.create_connection((host, port), timeout=5)
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_bad_requests_and_strangers_leave_the_server_serving(tmp_path):
    env = server_env(1, 1, {**os.environ, **ps_env("sgd"), "PYTHONPATH": ROOT})
    server = _start_server(env, 0)
    addr = env["COMMRT_PS_SERVERS"]
    try:
        host, port = addr[len("tcp://"):].rsplit(":", 1)
        with _connect_when_listening(host, int(port)) as raw:  # not even ZMTP
            raw.sendall(b"GET / HTTP/1.0\r\n\r\n" + os.urandom(256))
        ctx = zmq.Context.instance()
        # a buggy member of the job: it holds the job secret (the per-user file the server reads
        # too), so its garbage gets past the handshake and must be dropped by the parser
        stranger = ctx.socket(zmq.DEALER)
        stranger.setsockopt(zmq.LINGER, 0)
        stranger.plain_username, stranger.plain_password = b"rank0", job_secret(load_config(environ=env), env)
        stranger.connect(addr)
        for junk in ([b"\xc1\xc1"], [b"\x96" + os.urandom(40)], [os.urandom(5000), b"x"]):
            stranger.send_multipart(junk)
        _, out = run_ranks(1, "ps_probe", env={k: env[k] for k in env if k.startswith("COMMRT_PS")}, timeout_s=40)
        assert "PROBE OK" in out, out
        assert re.search(r"'malformed': [1-9]", out) and re.search(r"'rejected': [1-9]", out), out
        stranger.close()
    finally:
        logs = _stop_servers([server])
    assert "dropped a malformed request" in logs and "rejected push" in logs, logs


def test_bench_ps_prints_a_checked_table_and_json(tmp_path):
    out = tmp_path / "ps.json"
    proc = subprocess.run([sys.executable, "-m", "commrt.bench.ps", "-w", "2", "-s", "2", "--params", "4K,64K",
                           "-n", "3", "--warmup", "1", "--json", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=90, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "push+pull" in proc.stdout and "allreduce" in proc.stdout
    import json
    doc = json.loads(out.read_text())
    assert [r["size"] for r in doc["rows"]] == [4096, 65536]
    assert all(r["ps_wrong"] == 0 and r["allreduce_wrong"] == 0 and r["ps_time_us"] > 0 and r["allreduce_time_us"] > 0
               for r in doc["rows"])


def test_ps_under_curve_binds_workers_to_their_keys(tmp_path):
    env = {**ps_env("sgd"), "COMMRT_SECURITY_MODE": "curve"}
    run_job(tmp_path, 2, 2, env, str(STEPS))
    ref = reference("sgd", 2, STEPS, **REF_HP["sgd"])
    for w in range(2):
        np.testing.assert_allclose(np.load(tmp_path / f"params-{w}.npy", allow_pickle=False), ref, rtol=0, atol=1e-6)
    _, out = run_ranks(1, "ps_probe", "--impersonate", env={**ps_env("sgd"), "COMMRT_SECURITY_MODE": "curve",
                                                            "COMMRT_PS_WORKERS": "2"}, servers=1, timeout_s=40)
    assert "PROBE OK" in out and "comes with rank0's key" in out, out
