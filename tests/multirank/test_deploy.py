"""The deploy recipes run as written on the emulated cluster (issue 20): each node is a network
namespace whose /etc/hosts (``ip netns exec`` mounts /etc/netns/<ns>/hosts) gives it the host
names a scheduler would, and the recipe's own entry runs there with the environment that
scheduler sets. A parameter-server job must end with the single-process reference's weights,
a collective job with the reference's results. Needs root and iproute2 (CI runs as root)."""
from __future__ import annotations

import contextlib
import io
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

from commrt import emulate
from commrt.deploy import ssh
from commrt.deploy.hostlist import Host
from commrt.runtime.errors import ConfigError
from commrt.launch import free_port
from commrt.transport.security import new_secret
from tests.multirank.harness import ROOT
from tests.multirank.test_multihost import run_all
from tests.multirank.test_ps import REF_HP, STEPS, ps_env, reference

PY = sys.executable
FAKES = os.path.join(ROOT, "tests", "multirank", "fakes")


@contextlib.contextmanager
def named_cluster(names: list[list[str]]):
    """An emulated cluster of len(names) nodes; node i answers to every name in names[i]
    (resolved through each namespace's own /etc/hosts, removed afterwards)."""
    try:
        emulate.check_usable(emulate.parse_shape("1gbit"))
    except ConfigError as exc:
        pytest.skip(str(exc))
    table = "127.0.0.1 localhost\n" + "".join(f"{emulate.node_address(i)} {' '.join(n)}\n"
                                              for i, n in enumerate(names))
    with emulate.cluster(len(names), emulate.parse_shape("1gbit")) as net:
        dirs = [os.path.join("/etc/netns", ns) for ns in net.namespaces]
        try:
            for d in dirs:
                os.makedirs(d)
                with open(os.path.join(d, "hosts"), "w") as fh:
                    fh.write(table)
            yield net
        finally:
            for d in dirs:
                shutil.rmtree(d, ignore_errors=True)


def _base_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMMRT_", "TORCHELASTIC_", "SLURM_"))}
    env.update(PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1",
               COMMRT_COMM_TIMEOUT_S="60", COMMRT_COMM_BACKEND="zmq")
    env.update(extra)
    return env


def _check_ps_result(out_dir, workers: int, log: str) -> None:
    ref = reference("adamw", workers, STEPS, **REF_HP["adamw"])
    for w in range(workers):
        got = np.load(os.path.join(out_dir, f"params-{w}.npy"), allow_pickle=False)
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-6, err_msg=f"worker {w}\n{log[-4000:]}")


@pytest.mark.timeout(300)
def test_slurm_sbatch_runs_a_parameter_server_job(tmp_path):
    """deploy/slurm/commrt.sbatch itself, its srun steps played by fakes/srun.py: 2 worker nodes
    and a shard on a third node, CURVE keys made once for the job and deleted at its end."""
    hosts = ["node01", "node02", "node03"]
    with named_cluster([[h] for h in hosts]) as net:
        fakebin = tmp_path / "bin"
        fakebin.mkdir()
        (fakebin / "srun").write_text(f"#!/bin/sh\nexec {PY} {FAKES}/srun.py \"$@\"\n")
        (fakebin / "srun").chmod(0o755)
        env = _base_env(**ps_env("adamw"), PATH=f"{fakebin}:{os.environ['PATH']}", SLURM_JOB_ID="4242",
                        SLURM_JOB_NODELIST="node[01-03]", SLURM_JOB_NUM_NODES="3", SLURM_NNODES="3",
                        SLURM_SUBMIT_DIR=ROOT, WORKER_NODES="2", NPROC="1", SERVERS="1", COMMRT_PYTHON=PY,
                        CREDENTIALS_DIR=str(tmp_path), MASTER_PORT=str(free_port()),
                        FAKE_SLURM_HOSTS=",".join(hosts), FAKE_SLURM_NAMESPACES=",".join(net.namespaces))
        (out,) = run_all([(["bash", "deploy/slurm/commrt.sbatch", PY, "-m", "tests.multirank.programs.ps_job",
                            str(tmp_path), str(STEPS)], env)], timeout_s=240)
    _check_ps_result(tmp_path, 2, out)
    assert "STATS" in out and not list(tmp_path.glob(".commrt-credentials-*")), out[-3000:]


@pytest.mark.timeout(300)
def test_hosts_launcher_runs_a_collective_job_over_ssh(tmp_path):
    """``commrt launch --hosts``, ssh played by fakes/ssh.py (a bare environment in the host's
    namespace): the job secret reaches every host through stdin alone; without it no host could
    authenticate (the secret file is unreachable)."""
    hosts = ["node01", "node02"]
    with named_cluster([[h] for h in hosts]) as net:
        (tmp_path / "hosts").write_text("# two nodes\nnode01 slots=1\nnode02\n")
        secret, log = new_secret(), tmp_path / "ssh.log"
        env = _base_env(COMMRT_JOB_SECRET=secret, COMMRT_SECURITY_ALLOW_INSECURE="1",
                        COMMRT_SECURITY_SECRET_FILE="/proc/nonexistent/job_secret", FAKE_SSH_LOG=str(log),
                        FAKE_SSH_NAMESPACES=",".join(f"{h}={ns}" for h, ns in zip(hosts, net.namespaces)))
        cmd = [PY, "-m", "commrt.cli", "launch", "--hosts", str(tmp_path / "hosts"), "-n", "1",
               "--master-port", str(free_port()), "--ssh", f"{PY} {FAKES}/ssh.py", "--timeout", "200",
               "--", PY, "-m", "tests.multirank.programs.deploy_collective", "2", "1"]
        (out,) = run_all([(cmd, env)], timeout_s=240)
    assert out.count("deploy collective passed on 2 nodes x 1 ranks") == 2, out[-4000:]
    sent = log.read_text()
    assert sent.count("BatchMode") == 2 and secret not in sent and secret not in out


@pytest.mark.parametrize("security", ["curve", "secret"])
def test_slurm_sbatch_refuses_a_credentials_directory_it_did_not_make(tmp_path, security):
    """Found in review C: the batch script made its credentials with ``mkdir -p`` / ``keygen`` in
    ``$CREDENTIALS_DIR/.commrt-credentials-$SLURM_JOB_ID``, a name anyone can predict, so a
    directory made there in advance by another user (a group-shared submit directory) was used
    as it was: its owner could replace allow.txt or a rank's key while the job ran. And the
    EXIT trap deleted that directory, whoever's it was. Now the directory must be new (0700)."""
    fakebin, calls = tmp_path / "bin", tmp_path / "srun.log"
    fakebin.mkdir()
    (fakebin / "srun").write_text(f"#!/bin/sh\necho \"$*\" >> {calls}\n")
    (fakebin / "srun").chmod(0o755)
    planted = tmp_path / ".commrt-credentials-4242"
    planted.mkdir()
    planted.chmod(0o777)
    (planted / "planted").write_text("")
    env = _base_env(PATH=f"{fakebin}:{os.environ['PATH']}", SLURM_JOB_ID="4242", SLURM_JOB_NUM_NODES="2",
                    SLURM_SUBMIT_DIR=ROOT, WORKER_NODES="2", NPROC="1", SERVERS="0", COMMRT_PYTHON=PY,
                    CREDENTIALS_DIR=str(tmp_path), SECURITY=security)
    proc = subprocess.run(["bash", "deploy/slurm/commrt.sbatch", "true"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and not calls.exists(), proc.stdout + proc.stderr
    assert sorted(p.name for p in planted.iterdir()) == ["planted"], "credentials written into it"
    assert "already exists" in proc.stderr, proc.stderr


FAKE_SSH = """#!/bin/sh
# -o BatchMode=yes HOST COMMAND: host 'bad' fails at once, the others run until their stdin ends
read -r secret
echo "$3 $secret" >> "$SSH_SEEN"
[ "$3" = bad ] && exit 5
cat > /dev/null
echo "$3 stopped"
"""


def test_hosts_launcher_hands_the_secret_over_stdin_and_stops_the_rest_on_a_failure(tmp_path):
    """The launcher's own logic with a stand-in ssh that runs nothing remote (no root needed)."""
    ssh, seen = tmp_path / "ssh", tmp_path / "seen"
    ssh.write_text(FAKE_SSH)
    ssh.chmod(0o755)
    (tmp_path / "hosts").write_text("good1\nbad\ngood2\n")
    secret = new_secret()
    proc = subprocess.run([PY, "-m", "commrt.cli", "launch", "--hosts", str(tmp_path / "hosts"), "-n", "1",
                           "--ssh", str(ssh), "--timeout", "60", "--", "true"], capture_output=True, text=True,
                          env=_base_env(COMMRT_JOB_SECRET=secret, SSH_SEEN=str(seen)), cwd=ROOT, timeout=120)
    assert proc.returncode == 5, proc.stdout + proc.stderr
    assert sorted(seen.read_text().split("\n")[:-1]) == [f"{h} {secret}" for h in ("bad", "good1", "good2")]
    assert "[good1] good1 stopped" in proc.stdout and "[good2] good2 stopped" in proc.stdout, proc.stdout
    assert "stopped every host" in proc.stderr and secret not in proc.stdout + proc.stderr


def test_hosts_launcher_reports_an_ssh_that_ended_at_once(tmp_path, monkeypatch):
    """Found in review C: an ssh that ended before the launcher wrote it the secret (a typo in
    --ssh such as '-p 22x', a wrapper that fails at once) made that write a BrokenPipeError
    traceback out of ``commrt launch --hosts``, without ssh's own message or exit status, and
    left that ssh unreaped. Here each ssh has ended before launch_hosts writes to it."""
    real = ssh.subprocess.Popen

    def ended(*args, **kwargs):
        p = real(*args, **kwargs)
        os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)  # ended, not reaped
        return p
    fake = tmp_path / "ssh"
    fake.write_text("#!/bin/sh\necho 'Bad port' >&2\nexit 255\n")
    fake.chmod(0o755)
    monkeypatch.setattr(ssh.subprocess, "Popen", ended)
    out = io.StringIO()
    code = ssh.launch_hosts([Host("node01", None), Host("node02", None)], 1, ["true"], 29500, str(fake),
                            env=_base_env(COMMRT_JOB_SECRET=new_secret()), out=out, timeout_s=60)
    assert code == 255 and out.getvalue().count("Bad port") == 2, out.getvalue()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hosts_launcher_stops_every_host_when_one_fails(tmp_path):
    hosts = ["node01", "node02"]
    with named_cluster([[h] for h in hosts]) as net:
        (tmp_path / "hosts").write_text("node01\nnode02\n")
        env = _base_env(COMMRT_JOB_SECRET=new_secret(), FAKE_SSH_LOG=str(tmp_path / "ssh.log"),
                        FAKE_SSH_NAMESPACES=",".join(f"{h}={ns}" for h, ns in zip(hosts, net.namespaces)))
        program = "import os, sys, time; node = os.environ['GROUP_RANK']; print('up', node, flush=True); " \
                  "sys.exit(5) if node == '1' else time.sleep(600)"
        proc = subprocess.run([PY, "-m", "commrt.cli", "launch", "--hosts", str(tmp_path / "hosts"), "-n", "1",
                               "--ssh", f"{PY} {FAKES}/ssh.py", "--timeout", "200", "--", PY, "-c", program],
                              env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 5, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "stopped every host" in proc.stderr and "up 0" in proc.stdout


K8S_NAMES = [["trainer-0.trainer", "trainer-0"], ["trainer-1.trainer", "trainer-1"],
             ["commrt-ps-0.commrt-ps", "commrt-ps-0"]]


def _k8s_env(pod: str, **extra) -> dict:
    """What the manifests in deploy/kubernetes give a pod (and what Kubernetes adds: HOSTNAME,
    JOB_COMPLETION_INDEX for the Indexed Job)."""
    return _base_env(**{"HOSTNAME": pod, "COMMRT_DEPLOY_WORKER_NODES": "2", "COMMRT_DEPLOY_NPROC": "1",
                        "COMMRT_DEPLOY_K8S_SUBDOMAIN": "trainer", "COMMRT_DEPLOY_K8S_PS": "commrt-ps", **extra})


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_kubernetes_pods_run_a_parameter_server_job(tmp_path):
    """The containers' args of deploy/kubernetes (``commrt node k8s worker|server``) in three
    namespaces named like the pods of the Indexed Job and the StatefulSet."""
    keys = tmp_path / "keys"
    subprocess.run([PY, "-m", "commrt.cli", "keygen", str(keys), "-n", "2", "-s", "1"], check=True,
                   env=_base_env(), capture_output=True)
    sec = dict(COMMRT_SECURITY_MODE="curve", COMMRT_SECURITY_KEYS_DIR=str(keys), COMMRT_DEPLOY_SERVERS="1",
               MASTER_PORT=str(free_port()), **ps_env("adamw"))
    with named_cluster(K8S_NAMES) as net:
        node = [PY, "-m", "commrt.cli", "node", "k8s"]
        server = subprocess.Popen(["ip", "netns", "exec", net.namespaces[2], *node, "server"], cwd=ROOT,
                                  env=_k8s_env("commrt-ps-0", **sec), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            workers = [(["ip", "netns", "exec", net.namespaces[i], *node, "worker", "--", PY, "-m",
                         "tests.multirank.programs.ps_job", str(tmp_path), str(STEPS)],
                        _k8s_env(f"trainer-{i}", JOB_COMPLETION_INDEX=str(i), **sec)) for i in range(2)]
            outs = run_all(workers, timeout_s=240)
        finally:
            if server.poll() is None:
                os.killpg(server.pid, signal.SIGTERM)
            slog = server.communicate(timeout=60)[0]
    _check_ps_result(tmp_path, 2, "\n".join(outs) + slog)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_kubernetes_pods_run_a_collective_job(tmp_path):
    sec = dict(COMMRT_JOB_SECRET=new_secret(), COMMRT_SECURITY_ALLOW_INSECURE="1", MASTER_PORT=str(free_port()),
               COMMRT_DEPLOY_NPROC="2")
    with named_cluster(K8S_NAMES[:2]) as net:
        cmds = [(["ip", "netns", "exec", net.namespaces[i], PY, "-m", "commrt.cli", "node", "k8s", "worker", "--",
                  PY, "-m", "tests.multirank.programs.deploy_collective", "2", "2"],
                 _k8s_env(f"trainer-{i}", JOB_COMPLETION_INDEX=str(i), **sec)) for i in range(2)]
        outs = run_all(cmds, timeout_s=240)
    assert sum(o.count("deploy collective passed on 2 nodes x 2 ranks") for o in outs) == 4, outs
