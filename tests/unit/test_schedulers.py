"""The scheduler mappings (commrt/deploy/hostlist.py, plan.py) against what the schedulers set.

SLURM values are those sbatch/srun export (SLURM_JOB_NODELIST in the compressed form
``scontrol show hostnames`` expands; SLURM_TASKS_PER_NODE as ``2(x3),1``; SLURM_NODEID and
SLURM_PROCID relative to the step); Kubernetes values those of an Indexed Job's pods
(JOB_COMPLETION_INDEX, HOSTNAME ``<job>-<index>``) and of a StatefulSet's (``<sts>-<ordinal>``)."""
from __future__ import annotations

import shlex

import pytest

from commrt.deploy import plan as P
from commrt.deploy.hostlist import Host, expand_hostlist, parse_hostfile, tasks_per_node
from commrt.apps.node import build_parser, resolve
from commrt.runtime.errors import ConfigError


@pytest.mark.parametrize("spec, hosts", [
    ("node01", ["node01"]),
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),  # no padding unless the lower bound has it
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("r[1-2]-n[1-2]", ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]),
    ("a[1],b[2-3].ib", ["a1", "b2.ib", "b3.ib"]),
    (" cn[0-1] ", ["cn0", "cn1"]),
])
def test_slurm_host_lists_expand_like_scontrol(spec, hosts):
    assert expand_hostlist(spec) == hosts


@pytest.mark.parametrize("spec", ["", "node[01-03", "node]1", "node[3-1]", "node[a-b]", "node[[1]]", "a,,b",
                                  "n[0-99999999]"])
def test_bad_host_lists_are_config_errors(spec):
    with pytest.raises(ConfigError, match="host list"):
        expand_hostlist(spec)


def test_tasks_per_node():
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert tasks_per_node("4") == [4]
    with pytest.raises(ConfigError, match="N\\(xK\\)"):
        tasks_per_node("2(3)")


def _slurm(**extra) -> dict:
    """A worker step of `srun --nodes=2 --ntasks-per-node=1` in a 3-node job with 1 shard (SLURM_PROCID
    equals SLURM_NODEID there; it differs here so that a test tells which one the mapping reads)."""
    env = dict(SLURM_JOB_ID="77", SLURM_JOB_NODELIST="node[01-03]", SLURM_JOB_NUM_NODES="3", SLURM_NNODES="2",
               SLURM_NODEID="1", SLURM_PROCID="3", SLURM_LOCALID="0", SLURM_NTASKS="2",
               COMMRT_DEPLOY_WORKER_NODES="2", COMMRT_DEPLOY_NPROC="4", COMMRT_DEPLOY_SERVERS="1")
    env.update(extra)
    return env


def test_slurm_worker_node():
    node = P.slurm_plan(_slurm(), "worker")
    assert (node.index, node.master_addr, node.servers) == (1, "node01", ("tcp://node03:29600",))
    assert node.command("py", ["train.py"]) == [
        "py", "-m", "commrt.cli", "launch", "-n", "4", "--nnodes", "2", "--node-rank", "1", "--master-addr",
        "node01", "--master-port", "29500", "--", "train.py"]
    assert node.environ() == {"COMMRT_PS_SERVERS": "tcp://node03:29600", "COMMRT_PS_WORKERS": "8",
                              "COMMRT_CLUSTER_BIND_HOST": "0.0.0.0"}
    assert "COMMRT_CLUSTER_BIND_HOST" not in node.environ({"COMMRT_CLUSTER_BIND_HOST": "10.0.0.5"})


def test_slurm_server_shards_take_the_step_rank_and_the_hosts_after_the_workers():
    env = _slurm(SLURM_NNODES="2", SLURM_NODEID="0", SLURM_PROCID="1", COMMRT_DEPLOY_SERVERS="2",
                 SLURM_JOB_NODELIST="node[01-04]", MASTER_PORT="1234", COMMRT_DEPLOY_PS_PORT="7000")
    node = P.slurm_plan(env, "server")
    assert node.servers == ("tcp://node03:7000", "tcp://node04:7001")
    assert node.command("py", extra=["--resume"]) == ["py", "-m", "commrt.cli", "server", "--index", "1", "--resume"]
    assert node.environ() == {"COMMRT_PS_SERVERS": "tcp://node03:7000,tcp://node04:7001", "COMMRT_PS_WORKERS": "8"}


def test_slurm_shards_share_worker_nodes_when_the_allocation_has_no_more():
    node = P.slurm_plan(_slurm(SLURM_JOB_NODELIST="node[01-02]", COMMRT_DEPLOY_SERVERS="3"), "worker")
    assert node.servers == ("tcp://node01:29600", "tcp://node02:29601", "tcp://node01:29602")


def test_slurm_collective_job_without_deploy_variables_uses_the_step():
    env = {k: v for k, v in _slurm().items() if not k.startswith("COMMRT_")}
    node = P.slurm_plan(env, "worker")
    assert (node.job.worker_nodes, node.job.nproc, node.servers, node.index) == (2, 1, (), 1)
    assert "COMMRT_PS_SERVERS" not in node.environ()


@pytest.mark.parametrize("change, match", [
    (dict(SLURM_JOB_NODELIST=""), "SLURM_JOB_NODELIST"),
    (dict(SLURM_NODEID="2"), "worker 2 is outside this job"),
    (dict(SLURM_NODEID="x"), "SLURM_NODEID"),
    (dict(COMMRT_DEPLOY_WORKER_NODES="5"), "5 worker nodes but the allocation has 3"),
    (dict(COMMRT_DEPLOY_NPROC="0"), "COMMRT_DEPLOY_NPROC"),
])
def test_slurm_mistakes_are_config_errors(change, match):
    with pytest.raises(ConfigError, match=match):
        P.slurm_plan(_slurm(**change), "worker")


def test_slurm_one_task_per_rank_gives_torchrun_variables():
    env = dict(SLURM_JOB_NODELIST="gpu[7-9]", SLURM_PROCID="5", SLURM_NTASKS="7", SLURM_LOCALID="1",
               SLURM_NODEID="2", SLURM_TASKS_PER_NODE="3(x2),1")
    assert P.slurm_rank_env(env) == dict(RANK="5", WORLD_SIZE="7", LOCAL_RANK="1", LOCAL_WORLD_SIZE="1",
                                         GROUP_RANK="2", NODE_RANK="2", MASTER_ADDR="gpu7", MASTER_PORT="29500",
                                         COMMRT_CLUSTER_BIND_HOST="0.0.0.0")
    env = {k: v for k, v in env.items() if k != "SLURM_TASKS_PER_NODE"}
    assert P.slurm_rank_env({**env, "SLURM_NTASKS_PER_NODE": "3"})["LOCAL_WORLD_SIZE"] == "3"
    with pytest.raises(ConfigError, match="SLURM_NTASKS_PER_NODE"):
        P.slurm_rank_env(env)


K8S = dict(COMMRT_DEPLOY_WORKER_NODES="3", COMMRT_DEPLOY_NPROC="2", COMMRT_DEPLOY_SERVERS="2",
           COMMRT_DEPLOY_K8S_SUBDOMAIN="trainer", COMMRT_DEPLOY_K8S_PS="commrt-ps")


def test_k8s_indexed_job_pod():
    node = P.k8s_plan({**K8S, "JOB_COMPLETION_INDEX": "2", "HOSTNAME": "trainer-2"}, "worker")
    assert (node.index, node.master_addr) == (2, "trainer-0.trainer")
    assert node.servers == ("tcp://commrt-ps-0.commrt-ps:29600", "tcp://commrt-ps-1.commrt-ps:29600")
    assert node.environ()["COMMRT_PS_WORKERS"] == "6"
    named = P.k8s_plan({**K8S, "JOB_COMPLETION_INDEX": "0", "COMMRT_DEPLOY_K8S_JOB": "lm-run-7"}, "worker")
    assert named.master_addr == "lm-run-7-0.trainer"  # a job name with dashes, given outright


def test_k8s_statefulset_pod_and_mistakes():
    assert P.k8s_plan({**K8S, "HOSTNAME": "commrt-ps-1"}, "server").index == 1
    with pytest.raises(ConfigError, match="not of the StatefulSet"):
        P.k8s_plan({**K8S, "HOSTNAME": "other-1"}, "server")
    with pytest.raises(ConfigError, match="outside this job"):
        P.k8s_plan({**K8S, "HOSTNAME": "commrt-ps-2"}, "server")
    with pytest.raises(ConfigError, match="JOB_COMPLETION_INDEX"):
        P.k8s_plan({**K8S, "HOSTNAME": "trainer-0"}, "worker")
    with pytest.raises(ConfigError, match="SUBDOMAIN"):
        P.k8s_plan({**K8S, "JOB_COMPLETION_INDEX": "0", "COMMRT_DEPLOY_K8S_SUBDOMAIN": ""}, "worker")


def test_host_files():
    text = "# cluster\nalice@node1 slots=2\n\nnode2   slots=2  # second\n"
    assert parse_hostfile(text) == [Host("alice@node1", 2), Host("node2", 2)]
    for bad, match in [("", "no hosts"), ("n1 slots=0", "slots=N"), ("n1 cpus=2", "slots=N"), ("-oProxy=x", "host name")]:
        with pytest.raises(ConfigError, match=match):
            parse_hostfile(bad)


def test_hosts_plans_and_the_remote_command_keep_the_secret_off_it():
    plans = P.hosts_plans([Host("alice@node1", None), Host("node2", None)], nproc=3, port=4000)
    assert [(p.index, p.master_addr, p.job.nproc) for p in plans] == [(0, "node1", 3), (1, "node1", 3)]
    with pytest.raises(ConfigError, match="same number of ranks"):
        P.hosts_plans([Host("a", 2), Host("b", 4)], nproc=2, port=1)
    env = {"COMMRT_JOB_SECRET": "s3cret-value-long-enough", "PYTHONPATH": "/src", "COMMRT_COMM_BACKEND": "gloo",
           "HOME": "/root", "AWS_SECRET": "x"}
    assert P.forwarded_env(env) == {"PYTHONPATH": "/src", "COMMRT_COMM_BACKEND": "gloo"}
    cmd = P.remote_command(plans[1], env, "/work dir", "/venv/bin/python", ["python", "t.py"])
    assert "s3cret" not in cmd and "AWS" not in cmd and cmd.startswith("cd '/work dir' && exec env ")
    argv = shlex.split(cmd.split(" && exec ", 1)[1])
    assert argv[argv.index("/venv/bin/python"):][:5] == ["/venv/bin/python", "-m", "commrt.cli", "node", "attach"]
    assert argv[-8:] == ["--node-rank", "1", "--master-addr", "node1", "--master-port", "4000", "--", "python", "t.py"][-8:]
    assert "COMMRT_CLUSTER_BIND_HOST=0.0.0.0" in argv and "COMMRT_COMM_BACKEND=gloo" in argv


def test_commrt_node_resolves_without_running_anything():
    args = build_parser().parse_args(["slurm", "worker", "--max-restarts", "2"])
    argv, added = resolve(args, ["train.py"], _slurm())
    assert argv[-5:] == ["29500", "--max-restarts", "2", "--", "train.py"] and added["COMMRT_PS_WORKERS"] == "8"
    argv, added = resolve(build_parser().parse_args(["slurm", "rank"]), ["t.py"], dict(
        SLURM_JOB_NODELIST="n1", SLURM_PROCID="0", SLURM_NTASKS="1", SLURM_LOCALID="0", SLURM_NODEID="0",
        SLURM_TASKS_PER_NODE="1"))
    assert argv == ["t.py"] and added["RANK"] == "0"
    with pytest.raises(ConfigError, match="program"):
        resolve(build_parser().parse_args(["k8s", "worker"]), [], {**K8S, "JOB_COMPLETION_INDEX": "0", "HOSTNAME": "trainer-0"})


def test_an_elastic_job_launches_with_min_to_max_nodes():
    node = P.slurm_plan(_slurm(COMMRT_DEPLOY_MIN_NODES="1", COMMRT_DEPLOY_RDZV_TIMEOUT="300"), "worker")
    assert node.launch_args(["train.py"]) == [
        "-n", "4", "--nnodes", "1:2", "--rdzv-timeout", "300", "--node-rank", "1", "--master-addr", "node01",
        "--master-port", "29500", "--", "train.py"]
    with pytest.raises(ConfigError, match="MIN_NODES=3 is more than the 2 worker nodes"):
        P.slurm_plan(_slurm(COMMRT_DEPLOY_MIN_NODES="3"), "worker").launch_args(["train.py"])
