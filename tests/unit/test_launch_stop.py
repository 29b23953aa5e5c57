"""The launcher's cleanup after a signal (commrt/launch.py, _stop_all) ends its processes even
when Popen's internal lock is stuck: CPython checks for signals right after Popen.poll acquires
that lock, so a SIGTERM / SIGHUP / Ctrl-C landing there leaves it held, and Popen.wait then
blocks for ever (seen in CI: a signalled launcher that never exited)."""
import signal
import subprocess
import sys
import threading

from commrt import launch


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
