"""Pure: a scheduler's environment -> what one node of a commrt job runs (no I/O, no os.environ).

A job is W worker nodes x G ranks plus S parameter-server shards (S = 0: collectives only).
Every recipe gives its nodes the job's shape in ``COMMRT_DEPLOY_*`` variables and lets the
scheduler say which node this is:

- SLURM: SLURM_NODEID (worker node), SLURM_PROCID (server shard, in the servers' own step),
  SLURM_JOB_NODELIST (the first host is node 0, where the job meets; the hosts after the W
  worker nodes carry the shards, or the first worker nodes do when the job has no more).
- Kubernetes: JOB_COMPLETION_INDEX of an Indexed Job (worker node), the StatefulSet ordinal in
  HOSTNAME (server shard); node 0 is reached at ``<job>-0.<subdomain>``, shard i at
  ``<statefulset>-<i>.<statefulset>`` (headless Services give those stable DNS names).
- Plain hosts: the line of the host file (``commrt launch --hosts``).
"""
from __future__ import annotations

import dataclasses
import re
import shlex
from typing import Mapping, Sequence

from commrt.runtime.errors import ConfigError
from commrt.deploy.hostlist import Host, expand_hostlist, tasks_per_node

DEFAULT_PORT = 29500
DEFAULT_PS_PORT = 29600
ROLES = ("worker", "server")
_ORDINAL = re.compile(r"^(.+)-(\d+)$")


def _int(env: Mapping[str, str], name: str, default: int | None = None, least: int = 0) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise ConfigError(f"${name} is not set (the scheduler or the recipe sets it)")
        return default
    if not raw.strip().isdecimal() or int(raw) < least:  # isdigit() takes '²', which int() refuses
        raise ConfigError(f"${name}={raw!r} is invalid; expected an integer >= {least}")
    return int(raw)


@dataclasses.dataclass(frozen=True)
class Job:
    """The job's shape, the same on every node."""
    worker_nodes: int
    """W: nodes that run workers (COMMRT_DEPLOY_WORKER_NODES)."""
    nproc: int = 1
    """G: ranks per worker node (COMMRT_DEPLOY_NPROC)."""
    servers: int = 0
    """S: parameter-server shards (COMMRT_DEPLOY_SERVERS); 0 for a collective-only job."""
    port: int = DEFAULT_PORT
    """Where node 0 serves the rendezvous (MASTER_PORT)."""
    ps_port: int = DEFAULT_PS_PORT
    """Shard i listens on ps_port + i (COMMRT_DEPLOY_PS_PORT)."""
    min_nodes: int = 0
    """Elastic when >= 1 (COMMRT_DEPLOY_MIN_NODES): ``--nnodes MIN:W``, the job goes on with at
    least this many worker nodes and takes lost ones back (issue 33); 0: a lost node ends the job."""
    rdzv_timeout_s: int = 0
    """``--rdzv-timeout`` of an elastic job (COMMRT_DEPLOY_RDZV_TIMEOUT); 0: launch's default."""


def job_from_env(env: Mapping[str, str], worker_nodes: int | None = None) -> Job:
    """The shape from COMMRT_DEPLOY_*; ``worker_nodes`` is the scheduler's count when the recipe
    does not set COMMRT_DEPLOY_WORKER_NODES."""
    return Job(_int(env, "COMMRT_DEPLOY_WORKER_NODES", worker_nodes, 1), _int(env, "COMMRT_DEPLOY_NPROC", 1, 1),
               _int(env, "COMMRT_DEPLOY_SERVERS", 0), _int(env, "MASTER_PORT", DEFAULT_PORT, 1),
               _int(env, "COMMRT_DEPLOY_PS_PORT", DEFAULT_PS_PORT, 1), _int(env, "COMMRT_DEPLOY_MIN_NODES", 0),
               _int(env, "COMMRT_DEPLOY_RDZV_TIMEOUT", 0))


@dataclasses.dataclass(frozen=True)
class NodePlan:
    """What one node (or one server shard) runs."""
    role: str
    index: int
    """Worker: the node rank (0..W-1); server: the shard index (0..S-1)."""
    job: Job
    master_addr: str
    servers: tuple[str, ...] = ()
    """``tcp://host:port`` of every shard, in shard order."""

    def __post_init__(self) -> None:
        count = self.job.worker_nodes if self.role == "worker" else self.job.servers
        if self.role not in ROLES or not 0 <= self.index < count:
            raise ConfigError(f"{self.role} {self.index} is outside this job ({count} {self.role}s: "
                              f"{self.job.worker_nodes} worker nodes, {self.job.servers} servers)")

    def environ(self, base: Mapping[str, str] = {}) -> dict[str, str]:
        """Variables to add to ``base`` for this node: the shards' addresses and the worker count,
        and a wildcard bind (peers are told the address that routes to node 0) unless ``base``
        already names an interface."""
        env = {}
        if self.servers:
            env.update(COMMRT_PS_SERVERS=",".join(self.servers),
                       COMMRT_PS_WORKERS=str(self.job.worker_nodes * self.job.nproc))
        if self.role == "worker" and not base.get("COMMRT_CLUSTER_BIND_HOST"):
            env["COMMRT_CLUSTER_BIND_HOST"] = "0.0.0.0"
        return env

    def command(self, python: str, program: Sequence[str] = (), extra: Sequence[str] = ()) -> list[str]:
        """The argv: ``commrt launch`` of this node's ranks, or ``commrt server`` of this shard."""
        if self.role == "server":
            return [python, "-m", "commrt.cli", "server", "--index", str(self.index), *extra]
        return [python, "-m", "commrt.cli", "launch", *self.launch_args(program, extra)]

    def launch_args(self, program: Sequence[str], extra: Sequence[str] = ()) -> list[str]:
        """``commrt launch``'s arguments for this worker node's ranks."""
        if not program:
            raise ConfigError("a worker node needs the program to run (after --)")
        j = self.job
        if j.min_nodes > j.worker_nodes:
            raise ConfigError(f"COMMRT_DEPLOY_MIN_NODES={j.min_nodes} is more than the {j.worker_nodes} worker nodes")
        nnodes = f"{j.min_nodes}:{j.worker_nodes}" if j.min_nodes else str(j.worker_nodes)
        elastic = ["--rdzv-timeout", str(j.rdzv_timeout_s)] if j.min_nodes and j.rdzv_timeout_s else []
        return ["-n", str(j.nproc), "--nnodes", nnodes, *elastic, "--node-rank", str(self.index),
                "--master-addr", self.master_addr, "--master-port", str(j.port), *extra, "--", *program]


def _servers(hosts: Sequence[str], job: Job) -> tuple[str, ...]:
    """Shard i on the host after the worker nodes, or on worker node i % W when the allocation has
    no more hosts; its port is ps_port + i, so shards sharing a host do not collide."""
    spare = len(hosts) >= job.worker_nodes + job.servers
    return tuple(f"tcp://{hosts[job.worker_nodes + i] if spare else hosts[i % job.worker_nodes]}:{job.ps_port + i}"
                 for i in range(job.servers))


def _slurm_hosts(env: Mapping[str, str]) -> list[str]:
    spec = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not spec:
        raise ConfigError("$SLURM_JOB_NODELIST is not set: run this inside a SLURM job (sbatch/salloc + srun)")
    return expand_hostlist(spec)


def slurm_plan(env: Mapping[str, str], role: str) -> NodePlan:
    """One srun task per worker node (SLURM_NODEID) or per server shard (SLURM_PROCID of the servers' step)."""
    hosts = _slurm_hosts(env)
    job = job_from_env(env, _int(env, "SLURM_NNODES", len(hosts), 1))
    if job.worker_nodes > len(hosts):
        raise ConfigError(f"{job.worker_nodes} worker nodes but the allocation has {len(hosts)}: {hosts}")
    index = _int(env, "SLURM_NODEID" if role == "worker" else "SLURM_PROCID")
    return NodePlan(role, index, job, hosts[0], _servers(hosts, job))


def slurm_rank_env(env: Mapping[str, str]) -> dict[str, str]:
    """torchrun's variables for one srun task per rank (``srun --ntasks-per-node=G``), for programs
    started without ``commrt launch``."""
    hosts = _slurm_hosts(env)
    node = _int(env, "SLURM_NODEID")
    if env.get("SLURM_TASKS_PER_NODE"):
        counts = tasks_per_node(env["SLURM_TASKS_PER_NODE"])
        local_world = counts[node] if node < len(counts) else counts[-1]
    else:
        local_world = _int(env, "SLURM_NTASKS_PER_NODE")
    out = dict(RANK=str(_int(env, "SLURM_PROCID")), WORLD_SIZE=str(_int(env, "SLURM_NTASKS", least=1)),
               LOCAL_RANK=str(_int(env, "SLURM_LOCALID")), LOCAL_WORLD_SIZE=str(local_world),
               GROUP_RANK=str(node), NODE_RANK=str(node), MASTER_ADDR=hosts[0],
               MASTER_PORT=str(_int(env, "MASTER_PORT", DEFAULT_PORT, 1)))
    if not env.get("COMMRT_CLUSTER_BIND_HOST"):  # as for a worker node: reachable from the other nodes
        out["COMMRT_CLUSTER_BIND_HOST"] = "0.0.0.0"
    return out


def _ordinal(name: str, what: str) -> tuple[str, int]:
    m = _ORDINAL.match(name.split(".")[0])
    if not m:
        raise ConfigError(f"{what} {name!r} does not end in -<index> (a StatefulSet or Indexed Job pod name)")
    return m.group(1), int(m.group(2))


def k8s_plan(env: Mapping[str, str], role: str) -> NodePlan:
    """A pod of the workers' Indexed Job (JOB_COMPLETION_INDEX) or of the servers' StatefulSet
    (the ordinal ending HOSTNAME). The Job's pods are ``<job>-<index>`` under the headless Service
    COMMRT_DEPLOY_K8S_SUBDOMAIN; the shards ``<sts>-<i>`` under a Service named like the
    StatefulSet (COMMRT_DEPLOY_K8S_PS)."""
    job = job_from_env(env)
    sts = env.get("COMMRT_DEPLOY_K8S_PS") or "commrt-ps"
    servers = tuple(f"tcp://{sts}-{i}.{sts}:{job.ps_port}" for i in range(job.servers))  # a pod each: one port
    if role == "server":
        name, index = _ordinal(env.get("HOSTNAME", ""), "HOSTNAME")
        if name != sts:
            raise ConfigError(f"server pod {env.get('HOSTNAME')!r} is not of the StatefulSet {sts!r} "
                              "(COMMRT_DEPLOY_K8S_PS)")
        return NodePlan(role, index, job, "", servers)
    index = _int(env, "JOB_COMPLETION_INDEX")
    subdomain = env.get("COMMRT_DEPLOY_K8S_SUBDOMAIN")
    if not subdomain:
        raise ConfigError("$COMMRT_DEPLOY_K8S_SUBDOMAIN is not set: the headless Service named in the pod's subdomain")
    name = env.get("COMMRT_DEPLOY_K8S_JOB") or _ordinal(env.get("HOSTNAME", ""), "HOSTNAME")[0]
    return NodePlan(role, index, job, f"{name}-0.{subdomain}", servers)


def hosts_plans(hosts: Sequence[Host], nproc: int, port: int, master_addr: str | None = None) -> list[NodePlan]:
    """``commrt launch --hosts``: line i of the host file is node i; node 0's host is where the job
    meets (``user@`` dropped) unless ``master_addr`` says otherwise. Every host runs the same
    number of ranks (RANK = node * G + local rank)."""
    slots = {h.slots or nproc for h in hosts}
    if len(slots) != 1:
        raise ConfigError(f"every host must run the same number of ranks; the host file gives {sorted(slots)}")
    job = Job(len(hosts), slots.pop(), 0, port)
    master = master_addr or hosts[0].name.rsplit("@", 1)[-1]
    return [NodePlan("worker", i, job, master) for i in range(len(hosts))]


FORWARD = ("PYTHONPATH", "COMMRT_CONFIG")
SECRET_NAME = "COMMRT_JOB_SECRET"


def forwarded_env(env: Mapping[str, str]) -> dict[str, str]:
    """What the ssh launcher passes to a host on the remote command line: PYTHONPATH, the config
    file and the COMMRT_* settings, never the job secret (it goes through ssh's stdin)."""
    return {k: v for k, v in env.items() if (k in FORWARD or k.startswith("COMMRT_")) and k != SECRET_NAME}


def remote_command(plan: NodePlan, env: Mapping[str, str], cwd: str, python: str, program: Sequence[str],
                   extra: Sequence[str] = ()) -> str:
    """The shell command ssh runs on a host: the same directory, the forwarded settings, and
    ``commrt node attach`` around this node's ``commrt launch`` (it reads the secret from stdin
    and stops the launch when the connection drops)."""
    assigns = [f"{k}={v}" for k, v in sorted({**forwarded_env(env), **plan.environ(env)}.items())]
    argv = ["env", *assigns, python, "-m", "commrt.cli", "node", "attach", "--", *plan.launch_args(program, extra)]
    return f"cd {shlex.quote(cwd)} && exec {shlex.join(argv)}"
