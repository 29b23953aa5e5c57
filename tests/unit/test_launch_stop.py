"""The launcher's cleanup after a signal (commrt/launch.py, _stop_all) ends its processes even
when Popen's internal lock is stuck: CPython checks for signals right after Popen.poll acquires
that lock, so a SIGTERM / SIGHUP / Ctrl-C landing there leaves it held, and Popen.wait then
blocks for ever (seen in CI: a signalled launcher that never exited)."""
import os
import signal
import subprocess
import sys
import threading
import time

from commrt.runtime import processes as launch


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)


def test_stop_all_ends_and_reaps_processes_whose_popen_lock_is_stuck():
    procs = [_sleeper(), _sleeper()]
    stuck = procs[0]._waitpid_lock  # what a signal between acquire and try leaves behind
    stuck.acquire()
    try:
        done = threading.Thread(target=launch._stop_all, args=(procs,), daemon=True)
        done.start()
        done.join(30)
        assert not done.is_alive(), "the cleanup blocked on Popen's lock"
        assert [p.returncode for p in procs] == [-signal.SIGTERM] * 2
    finally:
        stuck.release()
        for p in procs:  # by PID, only ours
            if p.returncode is None:
                p.kill()
                p.wait(10)


def _gone(pid: int) -> bool:
    """Ended (a zombie counts: whoever inherited it reaps it when it gets round to it)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_ranks_die_with_a_sigkilled_launcher():
    """issue 30 item 12: a SIGKILLed launcher runs no cleanup; its ranks used to run on as orphans."""
    rank = "import os, time; print('PID', os.getpid(), flush=True); time.sleep(60)"
    launcher = subprocess.Popen([sys.executable, "-m", "commrt.cli", "launch", "-n", "2", "--",
                                 sys.executable, "-c", rank], stdout=subprocess.PIPE, text=True)
    pids = []
    try:
        while len(pids) < 2:
            line = launcher.stdout.readline()
            assert line, "the launcher ended before its ranks started"
            if "PID" in line:
                pids.append(int(line.split("PID")[1]))
        launcher.kill()
        launcher.wait(10)
        deadline = time.monotonic() + 5
        while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(_gone(p) for p in pids), f"ranks {pids} outlived their launcher"
    finally:
        for p in pids:  # by PID, only the ranks this test started
            if not _gone(p):
                os.kill(p, signal.SIGKILL)
