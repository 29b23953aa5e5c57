import io
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from commrt.launch import free_port, launch, threads_per_rank
from tests.multirank.harness import ROOT, default_signals

PROBE = [sys.executable, "-m", "tests.multirank.programs.launcher_probe"]
ENV = {**os.environ, "PYTHONPATH": ROOT}


def test_launch_sets_torchrun_env_and_prefixes_output():
    out = io.StringIO()
    result = launch(3, PROBE, out=out, env=ENV, timeout_s=30)
    assert result.returncode == 0 and result.failed_rank is None
    lines = out.getvalue().splitlines()
    for r in range(3):
        assert any(l.startswith(f"[rank {r}] env RANK={r} WORLD_SIZE=3 LOCAL_RANK={r}") for l in lines), lines


def test_ranks_share_the_cores_unless_the_user_set_omp_num_threads():
    assert [threads_per_rank(n, cores=16) for n in (1, 2, 8, 16, 64)] == [16, 8, 2, 1, 1]
    out = io.StringIO()
    assert launch(2, PROBE, out=out, env={k: v for k, v in ENV.items() if k != "OMP_NUM_THREADS"},
                  timeout_s=30).returncode == 0
    assert set(re.findall(r"OMP_NUM_THREADS=(\w+)", out.getvalue())) == {str(threads_per_rank(2))}
    out = io.StringIO()
    assert launch(2, PROBE, out=out, env={**ENV, "OMP_NUM_THREADS": "3"}, timeout_s=30).returncode == 0
    assert set(re.findall(r"OMP_NUM_THREADS=(\w+)", out.getvalue())) == {"3"}


def _secrets(env) -> set:
    out = io.StringIO()
    assert launch(2, PROBE, out=out, env=env, timeout_s=30).returncode == 0
    return set(re.findall(r"SECRET=(\w+)", out.getvalue()))


def test_each_launched_job_gets_its_own_secret():
    env = {k: v for k, v in ENV.items() if k != "COMMRT_JOB_SECRET"}
    first, second = _secrets(env), _secrets(env)
    assert len(first) == len(second) == 1 and first != second and first != {"none"}
    # ranks that talk to parameter servers started elsewhere share the per-user secret with them
    assert _secrets({**env, "COMMRT_PS_SERVERS": "tcp://127.0.0.1:1"}) == {"none"}


def test_failed_rank_stops_the_rest():
    """The other ranks sleep for 600 s: waiting for them would end in the launch timeout (124)."""
    out = io.StringIO()
    result = launch(3, PROBE + ["fail"], out=out, env=ENV, timeout_s=100)
    assert result.failed_rank == 1 and result.returncode == 7
    assert "failing on purpose" in result.describe()
    assert not [pid for pid in result.pids if _running(pid)]  # stopped, not left behind


def test_cli_launch_exit_code():
    proc = subprocess.run([sys.executable, "-m", "commrt.cli", "launch", "-n", "2", "--", *PROBE, "fail"],
                          env=ENV, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 7
    assert "rank 1 failed with exit code 7" in proc.stderr


def test_torchrun_can_launch_commrt(tmp_path):
    """No commrt launcher, so no job secret in the environment: the ranks meet through the
    per-user secret file (here in tmp_path), created by whichever rank comes first. The same ranks
    then run torch.distributed's init_process_group("commrt") by env:// and by tcp://."""
    env = {k: v for k, v in ENV.items() if k != "COMMRT_JOB_SECRET"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), "-m", "tests.multirank.programs.torchrun_job"],
                          env={**env, "COMMRT_COMM_TIMEOUT_S": "30",
                               "COMMRT_SECURITY_SECRET_FILE": str(tmp_path / "secret")},
                          capture_output=True, text=True,
                          timeout=90, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("torchrun job passed") == 2
    assert (tmp_path / "secret").stat().st_mode & 0o077 == 0  # made private, and used


def test_bench_json_is_complete(tmp_path):
    path = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "commrt.cli", "bench", "all_reduce", "--backend", "zmq,gloo",
                           "--nproc", "2", "-b", "1K", "-e", "256K", "-f", "16", "-n", "2", "-w", "1",
                           "--physical", "--json", str(path)],
                          env=ENV, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(path.read_text())
    assert doc["backends"] == ["zmq", "gloo"] and doc["nproc"] == 2
    assert [r["zmq"]["size"] for r in doc["rows"]] == [1024, 16384, 262144]
    for row in doc["rows"]:
        assert row["ceiling"] > 0
        for b in ("zmq", "gloo"):
            assert row[b]["wrong"] == 0 and row[b]["time_us"] > 0 and row[b]["busbw"] > 0
    assert "# Avg bus bandwidth" in proc.stdout and "ratio" in proc.stdout


def test_init_with_config_object_and_overrides():
    from tests.multirank.harness import run_ranks
    _, out = run_ranks(2, "config_object")
    assert out.count("ok") == 2


def test_max_restarts_resumes_the_group_from_its_checkpoint(tmp_path):
    out = io.StringIO()
    env = {**os.environ, "PYTHONPATH": ROOT, "COMMRT_COMM_BACKEND": "zmq", "COMMRT_COMM_TIMEOUT_S": "60"}
    result = launch(3, [sys.executable, "-m", "tests.multirank.programs.restart_job", str(tmp_path)],
                    out=out, env=env, timeout_s=60, max_restarts=1)
    text = out.getvalue()
    assert result.returncode == 0, text
    assert result.failures == ["rank 1 failed with exit code 3 (attempt 1); restarting the group (1/1)"], text
    assert text.count("attempt 1 resumes at step 5") == 3, text
    expected = sum(3 * step + 3 for step in range(10))  # sum over ranks of (step + rank)
    assert text.count(f"FINAL {float(expected)}") == 3, text


def _running(pid: int) -> bool:
    """Alive and not a zombie (a zombie has ended; only its exit status is left)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _children(pid: int) -> set[int]:
    kids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    if int(fh.read().rsplit(")", 1)[1].split()[1]) == pid:
                        kids.add(int(entry))
            except (FileNotFoundError, ProcessLookupError):
                continue
    return kids


def _wait_until(what: str, check, deadline_s: float = 90.0):
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"gave up waiting for {what} after {deadline_s}s")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_signalled_launcher_stops_its_ranks_and_servers(tmp_path, sig):
    """As `timeout` or a scheduler does it: the launcher's ranks (and their children) and its
    --servers shards must all be gone once the launcher has exited, and its exit code says why."""
    cmd = [sys.executable, "-m", "commrt.cli", "launch", "-n", "2", "--servers", "1", "--",
           *PROBE, "hang", str(tmp_path)]
    launcher = subprocess.Popen(cmd, env=ENV, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                preexec_fn=default_signals)
    pids: set[int] = set()
    try:
        files = [tmp_path / f"rank{r}.pids" for r in range(2)]
        _wait_until("both ranks to start", lambda: all(f.exists() for f in files))
        pids |= {int(p) for f in files for p in f.read_text().split()}
        server = _wait_until("the server to start", lambda: _children(launcher.pid) - pids)
        pids |= server
        assert all(_running(p) for p in pids)
        launcher.send_signal(sig)
        assert launcher.wait(timeout=60) == 128 + sig
        _wait_until("every process the launcher started to end",
                    lambda: not [p for p in pids if _running(p)], deadline_s=60)
    finally:  # on failure, leave nothing behind: by PID, only what this test started
        for pid in [launcher.pid, *pids]:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
        launcher.wait()


@pytest.mark.parametrize("module", ["workers.allreduce_check", "workers.train_lm", "workers.ps_train", "servers.ps"])
def test_entry_folders_still_run_from_the_repository_root(module):
    """The README's commands (`python -m workers.allreduce_check`, ...) run from a clone: the
    folders are thin entry points over commrt.apps, which an installed commrt carries."""
    proc = subprocess.run([sys.executable, "-m", module, "--help"], env=ENV, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "usage:" in proc.stdout, proc.stdout + proc.stderr


def test_max_restarts_keeps_the_parameter_servers_running(tmp_path):
    out = io.StringIO()
    env = {**os.environ, "PYTHONPATH": ROOT, "COMMRT_PS_TIMEOUT_S": "60"}
    result = launch(2, [sys.executable, "-m", "tests.multirank.programs.restart_job", str(tmp_path), "ps"],
                    out=out, env=env, timeout_s=100, servers=1, max_restarts=1)
    text = out.getvalue()
    assert result.returncode == 0 and len(result.failures) == 1, text
    assert text.count("listening on") == 1, text  # started once
    assert "attempt 1 server-status: server 0 holds 1 segments, 32 bytes" in text, text  # state kept


def _failing_rank(after_s: float) -> list[str]:
    """Rank 1 exits 1 after ``after_s`` (on every attempt); rank 0 sleeps until it is stopped."""
    return [sys.executable, "-c", f"import os, sys, time\nif os.environ['RANK'] == '1':\n"
                                  f"    time.sleep({after_s}); sys.exit(1)\ntime.sleep(60)\n"]


def test_the_timeout_bounds_the_whole_launch_restarts_included():
    """Each attempt (--max-restarts) restarted the clock: a rank failing every 1.5 s under a 3 s
    timeout ran 4 attempts for 6.5 s and ended with its own code, never 124."""
    start = time.monotonic()
    result = launch(2, _failing_rank(1.5), out=io.StringIO(), timeout_s=3.0, max_restarts=3)
    assert result.returncode == 124 and len(result.failures) == 1, (result.returncode, result.failures)
    assert time.monotonic() - start < 4.5


def test_the_timeout_bounds_the_wait_for_the_others_after_a_failure():
    """stop_on_failure=False waits a second time, for the ranks left: its clock restarted too."""
    start = time.monotonic()
    result = launch(2, _failing_rank(1.0), out=io.StringIO(), timeout_s=2.0, stop_on_failure=False)
    assert result.returncode == 124 and time.monotonic() - start < 2.7, time.monotonic() - start


RESTARTING_RANK = ("import os, sys, numpy as np, commrt\n"
                   "if os.environ['COMMRT_RESTART_COUNT'] == '0': sys.exit(3)\n"
                   "commrt.init_process_group(); a = np.ones(4, np.float32); commrt.all_reduce(a)\n"
                   "print('SUM', a.sum(), 'MASTER_PORT', os.environ['MASTER_PORT'], flush=True)\n"
                   "commrt.destroy_process_group()\n")


def test_max_restarts_re_forms_a_job_of_several_launchers():
    """Two launchers, one node each (--nnodes 2, not elastic): every rank of attempt 0 fails, both
    restart, and attempt 1's ranks must meet again. Each launcher gave attempt 1 a port it had
    picked alone (free_port), so the nodes disagreed on MASTER_PORT and rank 0 timed out."""
    from commrt.transport.security import new_secret
    port = free_port()
    env = {**ENV, "COMMRT_JOB_SECRET": new_secret(), "COMMRT_COMM_BACKEND": "zmq", "COMMRT_COMM_TIMEOUT_S": "10"}
    procs = [subprocess.Popen([sys.executable, "-m", "commrt.cli", "launch", "-n", "1", "--nnodes", "2",
                               "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
                               "--max-restarts", "1", "--timeout", "60", "--", sys.executable, "-c", RESTARTING_RANK],
                              env=env, cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              preexec_fn=default_signals) for node in (0, 1)]
    outs = [p.communicate(timeout=90)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert all(f"SUM 8.0 MASTER_PORT {port}" in out and "restarting the group (1/1)" in out for out in outs), outs


def _cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "commrt.cli", *args], env={**ENV, **kw.pop("env", {})},
                          cwd=ROOT, capture_output=True, text=True, timeout=100, **kw)


def test_config_command_validates_and_prints(tmp_path):
    good, bad = tmp_path / "good.toml", tmp_path / "bad.toml"
    good.write_text('[comm]\nbackend = "gloo"\ntimeout_s = 12\n')
    bad.write_text('[comm]\nbakend = "gloo"\n')
    proc = _cli("config", str(good))
    assert proc.returncode == 0 and re.search(r'^backend = "gloo"  # file ', proc.stdout, re.M) \
        and re.search(r"^timeout_s = 12(\.0)?  # file ", proc.stdout, re.M), proc.stdout
    assert re.search(r"# digest \w+", proc.stdout), proc.stdout
    proc = _cli("config", str(bad))
    assert proc.returncode == 1 and "ConfigError" in proc.stderr and "bakend" in proc.stderr, proc


def test_keygen_command(tmp_path):
    proc = _cli("keygen", str(tmp_path / "keys"), "-n", "2", "-s", "1")
    assert proc.returncode == 0, proc
    names = sorted(p.name for p in (tmp_path / "keys").iterdir())
    assert names == ["allow.txt", "rank0.key", "rank1.key", "server0.key"], names
    assert all((tmp_path / "keys" / n).stat().st_mode & 0o077 == 0 for n in names if n.endswith(".key"))
    allow = (tmp_path / "keys" / "allow.txt").read_text().split()
    assert allow[0::2] == ["rank0", "rank1", "server0"], allow


def test_bench_plot_writes_a_png_or_says_what_it_needs(tmp_path):
    png = tmp_path / "bw.png"
    proc = _cli("bench", "all_reduce", "--nproc", "2", "-b", "1K", "-e", "4K", "-n", "1", "-w", "0", "--plot", str(png))
    try:
        import matplotlib  # noqa: F401
    except ImportError:  # refused before any rank starts, not after the whole run
        assert proc.returncode != 0 and "--plot needs matplotlib" in proc.stderr, proc
        assert "# Avg bus bandwidth" not in proc.stdout and not png.exists(), proc.stdout
        return
    assert proc.returncode == 0, proc
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_under_torchrun_measures_that_cluster(tmp_path):
    env = {k: v for k, v in ENV.items() if k != "COMMRT_JOB_SECRET"}
    path = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), "-m", "commrt.cli", "bench", "all_reduce",
                           "-b", "1K", "-e", "4K", "-f", "4", "-n", "2", "-w", "1", "--json", str(path)],
                          env={**env, "COMMRT_SECURITY_SECRET_FILE": str(tmp_path / "secret")},
                          capture_output=True, text=True, timeout=110, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(path.read_text())
    assert doc["nproc"] == 2 and [r["zmq"]["size"] for r in doc["rows"]] == [1024, 4096], doc
    assert all(r["zmq"]["wrong"] == 0 for r in doc["rows"]), doc


def test_train_lm_bytes_per_step_do_not_depend_on_the_step_count():
    """Issue 31.7: "sent per step" counts the steps after the first, whose bytes include the
    set-up (the parameters' initial broadcast); the whole run's average fell with --steps."""
    per_step = []
    for steps in (2, 4):
        out = io.StringIO()
        result = launch(2, [sys.executable, "-m", "workers.train_lm", "--steps", str(steps), "--dim", "32",
                            "--layers", "1", "--seq", "16", "--vocab", "64"], out=out, env=ENV, timeout_s=120)
        text = out.getvalue()
        assert result.returncode == 0, text
        found = re.findall(r"\[rank 0\] sent per step after the first ([\d.]+) MiB inside the node", text)
        assert len(found) == 1, text
        per_step.append(float(found[0]))
    assert per_step[0] > 0 and per_step[0] == per_step[1], per_step


_LEAVES_A_CHILD = """
import os, subprocess, sys, time
if os.environ["RANK"] == "0":  # a data-loader-like child in the rank's own process group
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    open(sys.argv[1], "w").write(str(child.pid))
    os._exit(3)  # a crash: no cleanup of the child (an OOM kill looks the same)
time.sleep(60)
"""



def test_a_crashed_ranks_children_do_not_outlive_the_launch(tmp_path):
    """Found in the hardening review (wtT4): the launcher signals each rank's process group only
    while the rank itself runs; a rank that crashed left what it had started running for good
    (orphans holding memory, GPUs, ports). Now every group is stopped, the crashed rank's too."""
    pid_file = tmp_path / "child.pid"
    result = launch(2, [sys.executable, "-c", _LEAVES_A_CHILD, str(pid_file)], out=io.StringIO(), env=ENV,
                    timeout_s=30)
    assert (result.returncode, result.failed_rank) == (3, 0)
    child = int(pid_file.read_text())
    try:
        assert not _running(child), "rank 0's child outlived the launch"
    finally:
        if _running(child):
            os.kill(child, signal.SIGKILL)


def test_output_without_newlines_is_passed_on_in_bounded_pieces():
    """Found in the hardening review (wtT4): the output pump read with readline() unbounded, so a
    rank writing without newlines (a progress bar, binary) was held whole in the launcher's memory
    (and kept in its tail of last lines) until the rank ended."""
    from commrt.runtime.processes import MAX_LINE
    out = io.StringIO()
    program = "import sys; sys.stdout.write('x' * (1 << 20)); sys.stdout.flush()"
    assert launch(1, [sys.executable, "-c", program], out=out, env=ENV, timeout_s=30).returncode == 0
    lines = out.getvalue().splitlines()
    assert max(len(l) for l in lines) <= MAX_LINE + len("[rank 0] ")
    assert sum(l.count("x") for l in lines) == 1 << 20


class _ClosedReader(io.StringIO):
    """The launcher's output after its reader went away (``commrt launch ... | head``)."""

    def write(self, text):
        raise BrokenPipeError(32, "Broken pipe")


def test_ranks_finish_when_the_launchers_output_is_closed():
    """Found in review C: with the reader of the launcher's output gone (``| head``), the pump
    thread died on BrokenPipeError, nobody drained the rank's pipe, and a rank printing more than
    a pipe holds (64 KiB) blocked for ever: the launch hung (here until its timeout, 124)."""
    program = "for i in range(20000): print('x' * 100)\nprint('done')"
    result = launch(2, [sys.executable, "-c", program], out=_ClosedReader(), env=ENV, timeout_s=30)
    assert (result.returncode, result.failed_rank) == (0, None), result.describe()
    assert result.tails[0][-1] == result.tails[1][-1] == "done"  # still kept for an error report
