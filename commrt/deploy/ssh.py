"""``commrt launch --hosts FILE``: one ``commrt launch`` per host over ssh, for clusters with
neither SLURM nor Kubernetes.

Line i of the host file is node i. Each host runs, in the same directory as here, ``commrt node
attach`` around its ``commrt launch --nnodes H --node-rank i --master-addr <host 0>``; the
non-secret settings travel as ``env K=V`` on the remote command, the job secret as the first
line of ssh's stdin (never on a command line, where ``ps`` would show it). The first host to
fail stops the others: their stdin is closed, so their ``attach`` stops its launch with SIGTERM,
and ssh processes still running after the grace period are stopped here.
"""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from typing import IO, Sequence

from commrt.launch import GRACE_S, REAP_S, _exited, _pump, _wait_exited
from commrt.deploy import plan as P
from commrt.deploy.hostlist import Host


def _start(argv: list[str], label: str, secret: str, out: IO[str], lock: threading.Lock, tail: deque):
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         start_new_session=True)
    try:
        p.stdin.write((secret + "\n").encode())
        p.stdin.flush()  # left open: its end tells the host to stop
    except BrokenPipeError:  # ssh ended already (a bad option, a host it refused): _wait reports its status
        pass
    t = threading.Thread(target=_pump, args=(label, p.stdout, out, lock, tail, True), daemon=True)
    t.start()
    return p, t


def _close_all(procs: Sequence[subprocess.Popen]) -> None:
    for p in procs:
        try:
            p.stdin.close()
        except OSError:
            pass
    _wait_exited(procs, 2 * GRACE_S)  # the far side needs its own grace to stop its ranks
    for sig in (signal.SIGTERM, signal.SIGKILL):  # never a wait without an end (see launch._exited)
        for p in procs:
            if not _exited(p):
                p.send_signal(sig)
        _wait_exited(procs, GRACE_S if sig == signal.SIGTERM else REAP_S)


def launch_hosts(hosts: Sequence[Host], nproc: int, program: Sequence[str], port: int,
                 ssh: str = "ssh", master_addr: str | None = None, extra: Sequence[str] = (),
                 timeout_s: float | None = None, env: dict | None = None, out: IO[str] | None = None) -> int:
    """Start every host's node, wait; the first failure (or the deadline: 124) stops all."""
    env = dict(os.environ if env is None else env)
    plans = P.hosts_plans(hosts, nproc, port, master_addr)
    secret = env.get(P.SECRET_NAME) or ""
    out, lock = out or sys.stdout, threading.Lock()
    procs, pumps = [], []
    try:
        for host, node in zip(hosts, plans):
            remote = P.remote_command(node, env, os.getcwd(), sys.executable, program, extra)
            argv = [*shlex.split(ssh), "-o", "BatchMode=yes", host.name, remote]
            p, t = _start(argv, f"{host.name}", secret, out, lock, deque(maxlen=200))
            procs.append(p)
            pumps.append(t)
        code = _wait(procs, timeout_s)
    finally:
        _close_all(procs)
        for t in pumps:
            t.join(2.0)
    return code


def _wait(procs: Sequence[subprocess.Popen], timeout_s: float | None) -> int:
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        codes = [p.poll() for p in procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            return failed[0]
        if all(c == 0 for c in codes):
            return 0
        if deadline is not None and time.monotonic() > deadline:
            return 124
        time.sleep(0.05)
