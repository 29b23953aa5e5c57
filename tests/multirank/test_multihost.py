"""Multi-host for real (issue 12): ranks that bind the wildcard address and advertise another,
meeting at a third; torch's TCPStore bound like ours; and a job split across two network
namespaces joined by a veth pair (198.18.0.0/15, created here and removed on every exit path)
running the collective matrix and a parameter-server job across them."""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import uuid

import numpy as np
import pytest

from commrt.launch import free_port
from commrt.transport.security import new_secret
from tests.multirank.harness import ROOT

PY = sys.executable


def _env(rank: int, world: int, master: str, port: int, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMMRT_", "TORCHELASTIC_"))}
    env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
               MASTER_ADDR=master, MASTER_PORT=str(port), PYTHONUNBUFFERED="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               COMMRT_COMM_TIMEOUT_S="60")
    env.update(extra)  # the job secret among them: in the environment, never on a command line
    return env


def run_all(cmds: list[tuple[list[str], dict]], timeout_s: float = 300) -> list[str]:
    """Start every (argv, env) at once, wait for all, return each one's output; a non-zero exit
    or the deadline fails the test with every output. Only our own processes are signalled."""
    procs = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True, cwd=ROOT) for argv, env in cmds]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout_s)[0])
    except subprocess.TimeoutExpired:
        outs.append("(timed out)")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    text = "\n".join(f"--- process {i} (exit {p.returncode}) ---\n{o}" for i, (p, o) in enumerate(zip(procs, outs)))
    assert all(p.returncode == 0 for p in procs), text[-8000:]
    return outs


def _program(name: str, *args: str) -> list[str]:
    return [PY, "-m", f"tests.multirank.programs.{name}", *args]


def test_bind_everywhere_advertise_one_address_meet_at_another():
    """bind 0.0.0.0, advertise 127.0.0.2, rendezvous at 127.0.0.3 (all loopback)."""
    port, secret = free_port("127.0.0.3"), new_secret()
    extra = dict(COMMRT_COMM_BACKEND="zmq", COMMRT_CLUSTER_BIND_HOST="0.0.0.0",
                 COMMRT_CLUSTER_ADVERTISE_HOST="127.0.0.2", COMMRT_SECURITY_ALLOW_INSECURE="1")
    cmds = [(_program("multihost"), {**_env(r, 3, "127.0.0.3", port, **extra), "COMMRT_JOB_SECRET": secret})
            for r in range(3)]
    outs = run_all(cmds)
    for r, out in enumerate(outs):
        assert f"rank {r}: multihost passed on 3 ranks" in out, out
        advertised = re.search(r"ADVERTISED (.*)", out).group(1)
        assert "127.0.0.2:" in advertised and "0.0.0.0" not in advertised, out


def test_a_wildcard_bind_advertises_the_address_that_routes_to_the_master():
    """Without advertise_host, 0.0.0.0 used to be advertised: every peer then dialled itself."""
    port, secret = free_port(), new_secret()
    extra = dict(COMMRT_COMM_BACKEND="zmq", COMMRT_CLUSTER_BIND_HOST="0.0.0.0", COMMRT_SECURITY_ALLOW_INSECURE="1")
    outs = run_all([(_program("multihost"), {**_env(r, 2, "127.0.0.1", port, **extra), "COMMRT_JOB_SECRET": secret})
                    for r in range(2)])
    for out in outs:
        advertised = re.search(r"ADVERTISED (.*)", out).group(1)
        assert "tcp://127.0.0.1:" in advertised and "0.0.0.0" not in advertised, out


def test_torch_store_listens_where_ours_does():
    """Under gloo, rank 0's torch TCPStore used to listen on every interface (0.0.0.0 or ::)
    although our defaults promise loopback."""
    port, secret = free_port(), new_secret()
    outs = run_all([(_program("multihost"), {**_env(r, 2, "127.0.0.1", port, COMMRT_COMM_BACKEND="gloo"),
                                             "COMMRT_JOB_SECRET": secret}) for r in range(2)])
    listening = re.search(r"LISTENING (.*)", outs[0]).group(1).split()
    assert len(listening) >= 2, outs[0]  # our store, our data plane (gloo's own: connect-only)
    assert all(a.startswith("127.0.0.1:") for a in listening), listening


# -- IPv6 ------------------------------------------------------------------------------------

V6_LOOPBACK = "[00000000000000000000000000000001]:"  # ::1 as listening() prints it


def _ipv6_loopback() -> None:
    import socket
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("this host has no IPv6 loopback (::1)")


@pytest.mark.parametrize("backend,intra", [("zmq", "tcp"), ("zmq", "auto"), ("gloo", "auto")])
def test_an_ipv6_job_meets_listens_and_dials_over_ipv6(backend, intra):
    """MASTER_ADDR=::1 and bind_host ::1: the store, every rank's sockets (and torch's TCPStore
    under gloo) listen on ::1 only, ranks advertise tcp://[::1]:port, and the collectives match
    the reference. Before, lookup() sent ::1 to gethostbyname (IPv4 only) and failed init."""
    _ipv6_loopback()
    port, secret = free_port("::1"), new_secret()
    extra = dict(COMMRT_COMM_BACKEND=backend, COMMRT_COMM_INTRA_NODE=intra, COMMRT_CLUSTER_BIND_HOST="::1",
                 COMMRT_JOB_SECRET=secret)
    outs = run_all([(_program("multihost"), _env(r, 3, "::1", port, **extra)) for r in range(3)])
    for r, out in enumerate(outs):
        assert f"rank {r}: multihost passed on 3 ranks" in out, out
        listening = re.search(r"LISTENING (.*)", out).group(1).split()
        ours = [a for a in listening if a.startswith(V6_LOOPBACK)]
        if backend == "gloo":  # gloo's own pair listener is on the loopback interface, IPv4 here
            assert len(ours) >= (2 if r == 0 else 0), out  # rank 0: our store and torch's TCPStore
            assert all(a in ours or a.startswith("127.0.0.1:") for a in listening), out
        else:
            assert ours and ours == listening, out
        if backend == "zmq":
            advertised = re.findall(r"tcp://[^',\]]*\]?:\d+", re.search(r"ADVERTISED (.*)", out).group(1))
            assert advertised and all(a.startswith("tcp://[::1]:") for a in advertised), out


def test_a_wildcard_ipv6_bind_advertises_the_address_that_routes_to_the_master():
    """bind_host :: with the master at ::1: the route to it picks ::1, never :: itself."""
    _ipv6_loopback()
    port, secret = free_port("::1"), new_secret()
    extra = dict(COMMRT_COMM_BACKEND="zmq", COMMRT_CLUSTER_BIND_HOST="::", COMMRT_SECURITY_ALLOW_INSECURE="1",
                 COMMRT_JOB_SECRET=secret)
    outs = run_all([(_program("multihost"), _env(r, 2, "::1", port, **extra)) for r in range(2)])
    for out in outs:
        advertised = re.search(r"ADVERTISED (.*)", out).group(1)
        assert "tcp://[::1]:" in advertised and "[::]" not in advertised, out


# -- two network namespaces ------------------------------------------------------------------

def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@contextlib.contextmanager
def two_namespaces():
    """Namespaces A (198.18.0.1) and B (198.18.0.2) joined by a veth pair; always removed."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 (`ip`) to create network namespaces")
    tag = uuid.uuid4().hex[:6]
    names = (f"commrt-a-{tag}", f"commrt-b-{tag}")
    made = []
    try:
        for ns in names:
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", names[0], "link", "add", "veth-a", "type", "veth", "peer", "name", "veth-b", "netns", names[1])
        for ns, dev, addr in ((names[0], "veth-a", "198.18.0.1/24"), (names[1], "veth-b", "198.18.0.2/24")):
            _ip("-n", ns, "addr", "add", addr, "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
        yield names
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot create network namespaces here: {exc.stderr.strip()}")
    finally:
        for ns in made:  # deleting a namespace deletes its end of the veth pair, and so the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def _in(ns: str, argv: list[str]) -> list[str]:
    return ["ip", "netns", "exec", ns, *argv]


NETNS = dict(COMMRT_CLUSTER_BIND_HOST="0.0.0.0", COMMRT_SECURITY_ALLOW_INSECURE="1")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", ["zmq", "gloo"])
def test_collective_matrix_across_two_namespaces(backend):
    with two_namespaces() as (a, b):
        port, secret = 29511, new_secret()
        place = [a, a, b]  # ranks 0 and 1 beside the store, rank 2 on the other "host"
        cmds = [(_in(place[r], _program("matrix_subset")),
                 {**_env(r, 3, "198.18.0.1", port, COMMRT_COMM_BACKEND=backend, **NETNS),
                  "COMMRT_JOB_SECRET": secret}) for r in range(3)]
        outs = run_all(cmds, timeout_s=800)
        assert all("matrix passed on 3 ranks" in o for o in outs), outs


@pytest.mark.timeout(600)
def test_parameter_server_job_across_two_namespaces(tmp_path):
    from tests.multirank.test_ps import REF_HP, STEPS, ps_env, reference
    with two_namespaces() as (a, b):
        secret = new_secret()
        servers = "tcp://198.18.0.1:29611,tcp://198.18.0.2:29611"
        common = {**ps_env("adamw"), **NETNS, "COMMRT_PS_SERVERS": servers, "COMMRT_PS_WORKERS": "2"}
        server_cmds = [(_in(ns, [PY, "-m", "servers.ps", "--index", str(i)]), {**_env(0, 2, "127.0.0.1", 1, **common),
                                                                               "COMMRT_JOB_SECRET": secret})
                       for i, ns in enumerate((a, b))]
        servers_p = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True, cwd=ROOT) for argv, env in server_cmds]
        try:
            worker_cmds = [(_in(ns, _program("ps_job", str(tmp_path), str(STEPS))),
                            {**_env(w, 2, "127.0.0.1", 1, **common), "COMMRT_JOB_SECRET": secret})
                           for w, ns in enumerate((b, a))]  # each worker's first server is remote
            run_all(worker_cmds, timeout_s=200)
        finally:
            for p in servers_p:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGTERM)
            logs = [p.communicate(timeout=60)[0] for p in servers_p]
        ref = reference("adamw", 2, STEPS, **REF_HP["adamw"])
        for w in range(2):
            got = np.load(tmp_path / f"params-{w}.npy", allow_pickle=False)
            np.testing.assert_allclose(got, ref, rtol=0, atol=1e-6, err_msg=f"worker {w}: {logs}")
