"""``commrt launch``: start N local ranks with the torchrun environment, prefix their output
with the rank, and stop everyone as soon as one rank fails.

Only processes this launcher started are signalled, by PID (each rank leads its own process
group so that its children go with it). SIGTERM and SIGHUP to the launcher (``timeout``, a
scheduler, a closed terminal) stop everything it started, as SIGINT does, and end it with
128 + the signal number.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from typing import IO, Callable, Sequence

from commrt.runtime import addresses
from commrt.runtime.config import load_config
from commrt.runtime.errors import ConfigError
from commrt.runtime.processes import Stopped, _start, _status, _stop_everything, _stop_on_signals  # noqa: F401 (Stopped: cli)
from commrt.runtime.processes import say
# deploy/ssh.py drives its hosts' processes with the same mechanics, imported from here
from commrt.runtime.processes import GRACE_S, REAP_S, _exited, _pump, _wait_exited  # noqa: F401


def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for ports it picks itself (a bind to port 0, a connection's source)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            low, high = map(int, fh.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


_given: collections.deque[int] = collections.deque(maxlen=256)  # this process's latest picks
_given_lock = threading.Lock()


def free_port(host: str = "127.0.0.1", avoid: Sequence[int] = ()) -> int:
    """A port nothing on ``host`` is bound to now, for a server that binds it later, from outside
    the kernel's ephemeral range (not in ``avoid``, nor one this process picked lately). A port
    the kernel handed out to a bind to 0 and released could be handed out again, to another
    process's bind to 0 or connection, before the server binds it: torchrun's store failed with
    EADDRINUSE so, beside tests that opened hundreds of sockets. Outside the range only another
    picker like this one can take it, and two processes pick the same port once in ~16,000:
    ``reserve_port`` holds it until the server binds. torch's default ports (29400-29599) are
    left alone."""
    port, held = reserve_port(host, avoid)
    held.close()
    return port


def reserve_port(host: str = "127.0.0.1", avoid: Sequence[int] = ()) -> tuple[int, socket.socket]:
    """``free_port``'s port and the socket that holds it: bound (not listening) with
    SO_REUSEADDR set after the bind, so another picker's plain test bind fails on it while a
    server's bind with SO_REUSEADDR (ZeroMQ's, torch's TCPStore) succeeds. The caller closes it
    once the server is up or gone (launch: when the job ends)."""
    low, high = _ephemeral_ports()
    below, above = range(max(1024, low - 16384), low), range(high + 1, 65536)
    pool = below if len(below) >= len(above) else above  # the larger side (both empty: the kernel's)
    pick, host, fam = random.SystemRandom(), addresses.bare(host), addresses.family(host)
    with _given_lock:
        for _ in range(64 if pool else 0):
            port = pick.choice(pool)
            if port in avoid or port in _given or 29400 <= port < 29600:
                continue
            s = socket.socket(fam)
            try:
                s.bind((host, port))  # without SO_REUSEADDR: fails on any holder, server or TIME_WAIT
            except OSError:
                s.close()
                continue
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            _given.append(port)
            return port, s
    s = socket.socket(fam)  # nothing free outside the range: the kernel's choice
    s.bind((host, 0))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    return s.getsockname()[1], s


def _loopback(master_addr: str) -> str:
    """The loopback address of ``master_addr``'s family, where free_port looks."""
    return "::1" if addresses.is_ipv6(master_addr) else "127.0.0.1"


@dataclasses.dataclass
class LaunchResult:
    returncode: int
    failed_rank: int | None
    tails: dict[int, list[str]]
    """The last lines each rank printed (for error reports)."""
    pids: list[int] = dataclasses.field(default_factory=list)
    """Every process this launch started (ranks, then servers); all have exited by now."""
    failures: list[str] = dataclasses.field(default_factory=list)
    """One line per failed attempt that was followed by a restart (--max-restarts)."""

    def describe(self) -> str:
        if self.failed_rank is None:
            return "all ranks finished" if self.returncode == 0 else f"launch ended with {self.returncode}"
        who = f"rank {self.failed_rank}" if self.failed_rank >= 0 else f"server {-1 - self.failed_rank}"
        tail = "\n".join(f"    {line}" for line in self.tails.get(self.failed_rank, [])[-20:])
        return f"{who} failed with exit code {self.returncode}; its last lines:\n{tail}"


def rank_env(rank: int, nproc: int, port: int, base: dict | None = None, config: str | None = None,
             nnodes: int = 1, node_rank: int = 0, master_addr: str = "127.0.0.1") -> dict:
    """torchrun's variables for local rank ``rank`` of ``nproc`` on node ``node_rank`` of ``nnodes``
    (ranks of one node are contiguous: RANK = node_rank * nproc + rank)."""
    env = dict(os.environ if base is None else base)
    env.update(RANK=str(node_rank * nproc + rank), WORLD_SIZE=str(nnodes * nproc), LOCAL_RANK=str(rank),
               LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK=str(node_rank), NODE_RANK=str(node_rank),
               MASTER_ADDR=master_addr, MASTER_PORT=str(port), PYTHONUNBUFFERED="1")
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    if config:
        env["COMMRT_CONFIG"] = os.path.abspath(config)
    return env


@dataclasses.dataclass(frozen=True)
class Nodes:
    """Which nodes of a ``nnodes``-node job this launch starts, and how. ``node_rank`` None: all
    of them, here (a layout forced on one host, or an emulated cluster); ``wrap(node)`` gives
    the argv prefix and extra environment of a node's ranks (e.g. ``ip netns exec``)."""
    nnodes: int = 1
    node_rank: int | None = 0
    master_addr: str = "127.0.0.1"
    wrap: Callable[[int], tuple[list[str], dict]] | None = None

    def here(self) -> list[int]:
        return list(range(self.nnodes)) if self.node_rank is None else [self.node_rank]

    def whole_job(self) -> bool:
        return self.nnodes == 1 or self.node_rank is None



def server_env(servers: int, workers: int, base: dict | None = None, host: str = "127.0.0.1",
               held: list | None = None) -> dict:
    """Environment naming ``servers`` fresh parameter-server addresses on ``host`` (loopback).
    ``held``: where to keep the sockets reserving their ports (``reserve_port``), else none."""
    env = dict(os.environ if base is None else base)
    ports: list[int] = []
    for _ in range(servers):
        port, sock = reserve_port(host, avoid=ports)
        ports.append(port)
        if held is None:
            sock.close()
        else:
            held.append(sock)
    env["COMMRT_PS_SERVERS"] = ",".join(addresses.tcp_url(host, p) for p in ports)
    env["COMMRT_PS_WORKERS"] = str(workers)
    return env



def launch(nproc: int, cmd: Sequence[str], config: str | None = None, out: IO[str] | None = None,
           timeout_s: float | None = None, env: dict | None = None, prefix: bool = True,
           port: int | None = None, servers: int = 0, server_args: Sequence[str] = (),
           stop_on_failure: bool = True, max_restarts: int = 0, nodes: Nodes | None = None) -> LaunchResult:
    """Run ``cmd`` as ranks 0..nproc-1 on this host and wait; the first failure stops all.
    ``nodes``: ``nproc`` ranks per node for each node of ``nodes.here()`` (default: one node).

    With ``servers`` > 0, that many parameter-server shards (``python -m commrt.apps.ps_server``, as ``commrt server``) start
    first on free loopback ports, every process gets their addresses (COMMRT_PS_SERVERS), and
    they are stopped (SIGTERM: a final checkpoint) once the ranks are done.
    ``stop_on_failure=False`` lets the other ranks run on after one fails (fault-injection tests
    watch how they notice); the first failure is still reported.
    ``timeout_s``: the whole launch's bound, restarts included; when it passes every process is
    stopped and the result is 124.
    ``max_restarts``: after a failure, stop every rank and start the whole group again, up to
    this many times (the program resumes from its own checkpoint; TORCHELASTIC_RESTART_COUNT
    and COMMRT_RESTART_COUNT tell it which attempt it is). Servers keep running throughout.
    SIGTERM or SIGHUP (in the main thread) stop every rank and server, then raise ``Stopped``.
    """
    nodes = nodes or Nodes()
    if nproc < 1 or nodes.nnodes < 1 or not (nodes.node_rank is None or 0 <= nodes.node_rank < nodes.nnodes):
        raise ValueError(f"nproc ({nproc}) and nnodes ({nodes.nnodes}) must be >= 1 and node_rank "
                         f"({nodes.node_rank}) in 0..{nodes.nnodes - 1}")
    if servers and nodes.nnodes > 1:  # on this host's loopback: every node would train on shards of its own
        raise ValueError(f"servers ({servers}) are started on this host's loopback, which the ranks of "
                         f"{nodes.nnodes} nodes cannot all reach: start them apart and list them in [ps] servers")
    out = out or sys.stdout
    loopback = _loopback(nodes.master_addr)
    held: list[socket.socket] = []  # the ports this launch picked, reserved until it ends
    try:
        if not port:
            port, sock = reserve_port(loopback)
            held.append(sock)
        world = nproc * nodes.nnodes
        base = (server_env(servers, world, env, loopback, held) if servers
                else dict(os.environ if env is None else env))
        _reuse_freed_memory(base)
        base.setdefault("OMP_NUM_THREADS", str(threads_per_rank(nproc * len(nodes.here()))))
        deadline = None if timeout_s is None else time.monotonic() + timeout_s  # one clock for every attempt
        with _stop_on_signals(), _job_credentials(base, config, world, servers, nodes.whole_job()):
            return _run(nproc, cmd, config, out, deadline, base, prefix, port, servers, server_args,
                        stop_on_failure, max_restarts, nodes, held)
    finally:
        for sock in held:
            sock.close()


def threads_per_rank(local_ranks: int, cores: int | None = None) -> int:
    """The ranks' OMP_NUM_THREADS when the user set none: this host's cores shared among the
    ranks started here, at least 1. torch's default (every core, in every rank) puts ranks x
    cores threads on the cores; their OpenMP threads spin after each parallel region and take
    the cores the collectives run on (1 MiB all-reduce alone at 8 ranks on 16 cores: 23.7 ms).
    torchrun sets 1; sharing keeps a single rank's compute on all its cores."""
    if cores is None:
        try:
            cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cores = os.cpu_count() or 1
    return max(1, cores // max(1, local_ranks))


def _reuse_freed_memory(env: dict) -> None:
    """Start the ranks and servers with glibc's buffer-reuse thresholds (transport/memory.py):
    the speed of keep_freed_memory without the library changing a user's process.
    COMMRT_COMM_KEEP_FREED_MEMORY set to a false value in the environment turns it off."""
    from commrt.transport.memory import glibc_tunables
    if "COMMRT_COMM_KEEP_FREED_MEMORY" in env and not load_config(None, environ={
            "COMMRT_COMM_KEEP_FREED_MEMORY": env["COMMRT_COMM_KEEP_FREED_MEMORY"]}).comm.keep_freed_memory:
        return
    env["GLIBC_TUNABLES"] = glibc_tunables(env.get("GLIBC_TUNABLES", ""))


@contextlib.contextmanager
def _job_credentials(env: dict, config: str | None, nproc: int, servers: int, all_nodes: bool = True):
    """Under [security] mode = 'secret', when this launch starts every process of the job (no
    parameter servers started elsewhere) and no secret is set: a fresh secret for this job alone.
    Otherwise the processes read the per-user secret file, as separately started servers do.
    Under 'curve' without a keys_dir: a throw-away key set for this job (one key pair per rank
    and server, deleted afterwards). A launch that starts one node of several makes neither:
    the other hosts could not know them (give every host the same secret or keys_dir)."""
    from commrt.transport.security import SECRET_ENV, keygen, new_secret
    cfg = load_config(config, environ=env)
    whole_job = all_nodes and (servers > 0 or not cfg.ps.servers)
    if cfg.security.mode == "secret" and whole_job and not env.get(SECRET_ENV):
        env[SECRET_ENV] = new_secret()
    if cfg.security.mode != "curve" or cfg.security.keys_dir:
        yield
        return
    if not all_nodes:
        raise ConfigError("[security] mode = 'curve' across hosts needs keys_dir: run `commrt keygen` once "
                          "and give every host the directory (throw-away keys cannot reach other hosts)")
    with tempfile.TemporaryDirectory(prefix="commrt-keys-") as directory:
        keygen(directory, [f"rank{r}" for r in range(nproc)] + [f"server{i}" for i in range(servers)])
        env["COMMRT_SECURITY_KEYS_DIR"] = directory
        yield


def _run(nproc, cmd, config, out, deadline, base, prefix, port, servers, server_args,
         stop_on_failure, max_restarts, nodes, held) -> LaunchResult:
    """The servers, then the ranks, restarted after a failure while restarts and time are left
    (``deadline``: launch's timeout_s as a time.monotonic() instant, shared by every attempt)."""
    lock = threading.Lock()
    stails = {i: deque(maxlen=200) for i in range(servers)}
    services, ranks, pumps, pids, failures = [], [], [], [], []
    try:
        for i in range(servers):
            senv = rank_env(0, nproc, port, base, config)
            p, t = _start([sys.executable, "-m", "commrt.apps.ps_server", "--index", str(i), *server_args], senv,
                          f"server {i}", out, lock, stails[i], prefix)
            services.append(p)
            pumps.append(t)
        for attempt in range(max_restarts + 1):
            env = dict(base, TORCHELASTIC_RESTART_COUNT=str(attempt), COMMRT_RESTART_COUNT=str(attempt))
            at = _attempt_port(port, attempt, nodes, held)
            code, failed, tails = _attempt(nproc, cmd, config, out, deadline, env, prefix, at, services,
                                           stop_on_failure, lock, pumps, pids, ranks, nodes)
            if code == 0 or failed is None or failed < 0 or attempt == max_restarts or _expired(deadline):
                break
            note = (f"rank {failed} failed with exit code {code} (attempt {attempt + 1}); restarting the "
                    f"group ({attempt + 1}/{max_restarts})")
            failures.append(note)
            say(out, lock, f"[launch] {note}")
    finally:  # every rank of every attempt too: a signal may have cut an attempt short
        _stop_everything(ranks + services)
    for t in pumps:
        t.join(2.0)
    if failed is not None and failed < 0:
        tails[failed] = list(stails[-1 - failed])
    return LaunchResult(code, failed, tails, pids + [p.pid for p in services], failures)


def _attempt_port(port: int, attempt: int, nodes: Nodes, held: list) -> int:
    """MASTER_PORT of an attempt. Every host's launcher must give its ranks the same one, so a
    job of several launchers keeps ``port``: a port picked here would be this host's alone and
    the nodes could never meet again. The store rebinds it at once (ZeroMQ listens with
    SO_REUSEADDR; a port still held retries, StoreServer's bind_within_s) and its incarnation
    token refuses a straggler of the last attempt. A launch that starts every rank takes a
    fresh port, so that nothing of the last attempt can reach the new store at all."""
    if attempt == 0 or not nodes.whole_job():
        return port
    port, sock = reserve_port(_loopback(nodes.master_addr))
    held.append(sock)  # until the launch ends, as the first attempt's
    return port


def _expired(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline


def _attempt(nproc, cmd, config, out, deadline, env, prefix, port, services, stop_on_failure,
             lock, pumps, pids, procs, nodes) -> tuple[int, int | None, dict]:
    """One start of the group; its processes are added to ``procs`` as they start."""
    ranks = [(n, n * nproc + r) for n in nodes.here() for r in range(nproc)]  # (node, global rank)
    tails = {g: deque(maxlen=200) for _, g in ranks}
    first = len(procs)
    try:
        for node, g in ranks:
            argv, extra = nodes.wrap(node) if nodes.wrap else ([], {})
            renv = rank_env(g - node * nproc, nproc, port, env, config, nodes.nnodes, node, nodes.master_addr)
            p, t = _start([*argv, *cmd], {**renv, **extra}, f"rank {g}", out, lock, tails[g], prefix)
            procs.append(p)
            pids.append(p.pid)
            pumps.append(t)
        mine = procs[first:]
        code, failed = _watch(mine, deadline, services)
        if failed is not None and failed >= 0:
            failed = ranks[failed][1]
        if failed is not None and failed >= 0 and not stop_on_failure:
            if _watch(mine, deadline, services, until_all=True)[0] == 124:
                code, failed = 124, None  # the others never finished
    except BaseException:  # KeyboardInterrupt included: never leave ranks behind
        _stop_everything(procs)
        raise
    if failed is not None or code != 0:
        _stop_everything(procs)
    return code, failed, {r: list(t) for r, t in tails.items()}


def _watch(procs: list[subprocess.Popen], deadline: float | None,
           services: Sequence[subprocess.Popen] = (), until_all: bool = False) -> tuple[int, int | None]:
    """Wait for the ranks; a failed rank (or a service that exits early) ends the wait, unless
    ``until_all``; 124 at ``deadline`` (launch's, not this wait's: timeout_s bounds the whole
    launch, restarts included). Services are reported as rank -1 - index."""
    while True:
        pending = False
        for rank, p in enumerate(procs):
            rc = _status(p)  # not reaped: _stop_everything can still stop what it left running
            if rc is None:
                pending = True
            elif rc != 0 and not until_all:
                return (128 - rc if rc < 0 else rc), rank
        if not pending:
            return 0, None
        for i, p in enumerate(services):
            rc = _status(p)  # not reaped: _stop_everything can still stop what it left running
            if rc is not None:
                return (128 - rc if rc < 0 else rc) or 1, -1 - i
        if deadline is not None and time.monotonic() > deadline:
            return 124, None
        time.sleep(0.02)
