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
print("MADE", " ".join(cmd[3] for cmd in made if cmd[:3] == ["ip", "netns", "add"]))
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
    made, deleted = lines[-2].split()[1:], lines[-1].split()[1:]
    assert set(deleted) == set(made) and all(n.startswith(emulate.PREFIX) for n in deleted), lines
    assert len(made) == (3 if when == "teardown" else 1), lines  # switch + 2 nodes; the switch alone so far


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


def test_a_setup_that_fails_deletes_what_it_made_and_reports_no_leftovers(monkeypatch, caplog):
    """Found in review C: when a setup command failed (a DELAY on a kernel without netem, the
    first node's tc), every planned namespace was deleted, those never made too, and each of
    those failures was logged as an ERROR "could not delete N network namespace(s)": the user
    was told namespaces were left behind when none were."""
    made, attempted = set(), []

    def run(cmd):
        if cmd[:3] == ["ip", "netns", "add"]:
            made.add(cmd[3])
        if cmd[:2] == ["tc", "-n"] and "-n0" in cmd[2]:
            raise emulate.ConfigError("this kernel has no netem qdisc")

    def delete(cmd, **kw):
        attempted.append(cmd[-1])
        gone = cmd[-1] in made
        made.discard(cmd[-1])
        return subprocess.CompletedProcess(cmd, 0 if gone else 1, "", "" if gone else "No such file or directory")
    monkeypatch.setattr(emulate, "check_usable", lambda shape: None)
    monkeypatch.setattr(emulate, "clean_leftovers", lambda: [])
    monkeypatch.setattr(emulate, "_run", run)
    monkeypatch.setattr(emulate.subprocess, "run", delete)
    with pytest.raises(emulate.ConfigError, match="netem"):
        with emulate.cluster(3, emulate.parse_shape("1gbit")):
            pass
    assert not made and len(attempted) == 2, attempted  # the switch and node 0: all that was made
    assert "could not delete" not in caplog.text, caplog.text


@pytest.mark.parametrize("hangs", ["tc", "netns add"])
def test_a_command_that_hangs_is_a_typed_error_naming_it_and_the_namespaces_go(monkeypatch, hangs):
    """An ip / tc command past its timeout was subprocess.TimeoutExpired, naming nothing of the
    cluster; now CommandHung names it, and every namespace that may exist is still deleted (a
    hung ``ip netns add`` may have made its namespace)."""
    calls, deleted = [], []

    def run(cmd, **kw):
        if cmd[:3] == ["ip", "netns", "del"]:
            deleted.append(cmd[3])
            return subprocess.CompletedProcess(cmd, 0, "", "")
        calls.append(cmd)
        if (hangs == "tc" and cmd[0] == "tc") or (hangs == "netns add" and len(calls) == 5):
            raise subprocess.TimeoutExpired(cmd, kw["timeout"])
        return subprocess.CompletedProcess(cmd, 0, "", "")
    monkeypatch.setattr(emulate, "check_usable", lambda shape: None)
    monkeypatch.setattr(emulate, "clean_leftovers", lambda: [])
    monkeypatch.setattr(emulate.subprocess, "run", run)
    with pytest.raises(emulate.CommandHung, match=r"`(tc -n|ip netns add) \S+.*` did not finish within 60 s") as info:
        with emulate.cluster(2, emulate.parse_shape("1gbit")):
            pass
    assert info.value.cmd == calls[-1]
    made = [cmd[3] for cmd in calls if cmd[:3] == ["ip", "netns", "add"]]
    assert len(made) == 2 and sorted(deleted) == sorted(made), (made, deleted)


def test_listing_namespaces_that_hangs_is_a_typed_error(monkeypatch):
    def run(cmd, **kw):
        raise subprocess.TimeoutExpired(cmd, kw["timeout"])
    monkeypatch.setattr(emulate.subprocess, "run", run)
    with pytest.raises(emulate.CommandHung, match="`ip netns list` did not finish within 30 s"):
        emulate.clean_leftovers()
