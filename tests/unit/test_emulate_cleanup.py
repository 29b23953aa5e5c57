"""An emulated cluster's namespaces are deleted however its block ends (emulate.cluster): every
one even when a deletion fails or hangs, and under SIGTERM during setup or teardown. No network
is touched: the commands that would make and delete namespaces are recorded instead."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from commrt import emulate

# a child process, so that SIGTERM on the code before the fix ends it, not the test run
_CHILD = """
import os, signal, subprocess, sys
from commrt import emulate
from commrt.runtime.processes import Stopped

when = sys.argv[1]
deleted, made = [], []
emulate.check_usable = lambda shape: None
emulate.clean_leftovers = lambda: []

def run(cmd):
    made.append(cmd)
    if when == "setup" and len(made) == 3:
        os.kill(os.getpid(), signal.SIGTERM)

def delete(cmd, **kw):
    deleted.append(cmd[-1])
    if when == "teardown" and len(deleted) == 1:
        os.kill(os.getpid(), signal.SIGTERM)
    return subprocess.CompletedProcess(cmd, 0, "", "")

emulate._run, subprocess.run = run, delete
try:
    with emulate.cluster(2, emulate.parse_shape("1gbit")):
        pass
except Stopped as exc:
    print("STOPPED", exc)
print("DELETED", " ".join(deleted), flush=True)
"""


@pytest.mark.parametrize("when", ["setup", "teardown"])
def test_sigterm_while_the_cluster_is_made_or_deleted_still_deletes_every_namespace(when):
    """emulate.cluster() ran outside the launcher's signal handling (launch() installs it for the
    run only): SIGTERM during setup or teardown killed the process with the namespaces left."""
    proc = subprocess.run([sys.executable, "-c", _CHILD, when], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0 and lines[0] == "STOPPED stopped by SIGTERM", (proc.returncode, proc.stderr[-2000:])
    deleted = lines[-1].split()[1:]
    assert len(set(deleted)) == 3 and all(n.startswith(emulate.PREFIX) for n in deleted), lines  # switch + 2 nodes


def test_one_deletion_that_hangs_does_not_keep_the_others(monkeypatch, caplog):
    attempted = []

    def run(cmd, **kw):
        attempted.append(cmd[-1])
        if len(attempted) == 1:
            raise subprocess.TimeoutExpired(cmd, 30)
        return subprocess.CompletedProcess(cmd, 1 if len(attempted) == 2 else 0, "", "busy")
    monkeypatch.setattr(emulate, "check_usable", lambda shape: None)
    monkeypatch.setattr(emulate, "clean_leftovers", lambda: [])
    monkeypatch.setattr(emulate, "_run", lambda cmd: None)
    monkeypatch.setattr(emulate.subprocess, "run", run)
    with emulate.cluster(2, emulate.parse_shape("1gbit")) as net:
        nodes = net.namespaces
    assert len(attempted) == 3 and set(nodes) < set(attempted)
    assert "could not delete 2 network namespace(s)" in caplog.text and "TimeoutExpired" in caplog.text
