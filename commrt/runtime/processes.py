"""The launcher's child processes: start one with its output pumped and prefixed and a
parent-death signal, tell when it has ended, and stop a set of them (SIGTERM, then SIGKILL after
``GRACE_S``), even when a signal left Popen's own lock held. Only processes the caller started
are signalled, by PID. Split from launch.py (issue 28 item 6): this is the process mechanics,
launch.py the job (environment, credentials, services, restarts)."""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import threading
import time
from collections import deque
from typing import IO, Callable, Sequence

GRACE_S = 5.0
REAP_S = 10.0  # after SIGKILL: how long to wait for the kernel to end a process (D state aside, ms)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Stopped(BaseException):
    """The launcher got SIGTERM or SIGHUP; every process it started has been stopped.
    A BaseException, like KeyboardInterrupt, so that no ``except Exception`` swallows it."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


@contextlib.contextmanager
def _stop_on_signals():
    """Turn SIGTERM/SIGHUP into ``Stopped`` in the main thread while a launch runs, so the
    cleanup that SIGINT gets runs for them too. Only the first one raises: a repeat during the
    cleanup must not cut it short. A handler someone else installed is left alone."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired: list[int] = []

    def handler(signum, _frame):
        if not fired:
            fired.append(signum)
            raise Stopped(signum)

    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS
                if signal.getsignal(sig) == signal.SIG_DFL}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)



MAX_LINE = 1 << 16  # a rank writing without newlines (progress bars, binary) is passed on in pieces


def _pump(label: str, stream: IO[bytes], out: IO[str], lock: threading.Lock, tail: deque, prefix: bool) -> None:
    # bounded reads: readline() alone held a rank's whole newline-free output in the launcher
    passing = True
    for raw in iter(lambda: stream.readline(MAX_LINE), b""):
        line = raw.decode(errors="replace").rstrip("\n")
        tail.append(line)
        if passing:
            # one label per line: a program's log format may have written it already (obs/logfmt.py)
            passing = say(out, lock, f"[{label}] {line}" if prefix and not line.startswith(f"[{label}]") else line)
    stream.close()


def say(out: IO[str], lock: threading.Lock, line: str) -> bool:
    """Write ``line`` to the launcher's output; False once that output is gone (its reader ended:
    ``commrt launch ... | head``). The pumps then go on draining the ranks' pipes, keeping only
    their tails: a pump that died on BrokenPipeError left its rank blocked on a full pipe, and
    the launch hung."""
    with lock:
        try:
            out.write(line + "\n")
            out.flush()
            return True
        except (OSError, ValueError):  # ValueError: the stream was closed
            return False


def _exited(p: subprocess.Popen) -> bool:
    """Whether ``p`` has ended (reaping it): ``Popen.poll`` without Popen's lock. CPython checks
    for signals right after ``poll`` acquires that lock, before its ``try``: a SIGTERM / SIGHUP
    (``Stopped``) or Ctrl-C landing there leaves the lock held for good, after which ``poll``
    says "running" and ``wait`` blocks for ever. The cleanup that follows such a signal must not
    depend on it."""
    if p.returncode is not None:
        return True
    try:
        pid, status = os.waitpid(p.pid, os.WNOHANG)
    except ChildProcessError:  # reaped already (by Popen, whose lock was free then)
        if p.returncode is None:
            p.returncode = -signal.SIGKILL
        return True
    if pid == 0:
        return False
    p.returncode = os.waitstatus_to_exitcode(status)
    return True


def _status(p: subprocess.Popen) -> int | None:
    """``p``'s exit code (negative: the signal) once it has ended, None while it runs, WITHOUT
    reaping it: an unreaped child keeps its PID, so its process group (PGID = that PID, from
    start_new_session) cannot be anyone else's, and what a crashed rank left running in it (a
    data loader's workers) can still be stopped by ``_stop_all``. Watchers use this, not
    ``Popen.poll``, which reaps; ``_stop_all`` reaps."""
    if p.returncode is not None or not hasattr(os, "waitid"):  # macOS has no waitid: reap as before
        _exited(p)
        return p.returncode
    try:
        info = os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped elsewhere
        _exited(p)
        return p.returncode
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def _signal_all(procs: Sequence[subprocess.Popen], sig: int) -> None:
    """``sig`` to the process group of every process not yet reaped, ended ones included (their
    children may run on; an unreaped leader's PGID cannot have been reused)."""
    for p in procs:
        if p.returncode is None:
            try:
                os.killpg(p.pid, sig)  # the rank's own group: it was started with a new session
            except ProcessLookupError:
                pass


def _stop_everything(procs: Sequence[subprocess.Popen]) -> None:
    """``_stop_all`` that a first SIGTERM arriving in the middle cannot leave half done."""
    try:
        _stop_all(procs)
    except Stopped:
        _stop_all(procs)
        raise


def _stop_all(procs: Sequence[subprocess.Popen]) -> None:
    """SIGTERM to every group, GRACE_S for the processes to end, SIGKILL to every group (what
    outlived its rank, or ignored SIGTERM), then reap."""
    _signal_all(procs, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while not all([_status(p) is not None for p in procs]) and time.monotonic() < deadline:
        time.sleep(0.02)
    _signal_all(procs, signal.SIGKILL)
    _wait_exited(procs, REAP_S)


def _wait_exited(procs: Sequence[subprocess.Popen], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not all([_exited(p) for p in procs]) and time.monotonic() < deadline:  # a list: reap every one
        time.sleep(0.02)



PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_this_process() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get SIGKILL when this process ends, however it ends
    (a SIGKILLed launcher runs no cleanup: its ranks were left running as orphans, issue 30
    item 12). prctl is looked up here, in the parent, so the child between fork and exec makes
    one foreign call and one getppid, no allocation or import. None where there is no prctl."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return None
    parent = os.getpid()

    def child() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before the line above took effect
            os._exit(1)
    return child


def _start(cmd: Sequence[str], env: dict, label: str, out: IO[str], lock: threading.Lock,
           tail: deque, prefix: bool) -> tuple[subprocess.Popen, threading.Thread]:
    # the parent-death signal follows the thread that forks: every rank and service is
    # started, watched and stopped by launch()'s own thread, which outlives them
    p = subprocess.Popen(list(cmd), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_this_process())
    t = threading.Thread(target=_pump, args=(label, p.stdout, out, lock, tail, prefix), daemon=True)
    t.start()
    return p, t
