"""``commrt launch``: its options and what it runs. Here, below the CLI, because two commands
start a launch: ``commrt launch`` itself and ``commrt node`` (apps/node.py), which becomes one in
its own process; and ``guarded`` turns what any command raises into an exit status."""
from __future__ import annotations

import argparse
import os
import sys

from commrt import launch as launcher
from commrt.apps.elastic_launch import launch_elastic
from commrt.runtime.config import unknown_variables
from commrt.runtime.errors import CommError


def add_arguments(lp: argparse.ArgumentParser) -> None:
    lp.add_argument("-n", "--nproc", "--nproc-per-node", type=int, required=True,
                    help="ranks to start on this node (torchrun's --nproc-per-node); required")
    lp.add_argument("--nnodes", default="1", help="nodes in the job (torchrun's --nnodes); MIN:MAX makes it elastic: "
                    "node 0's launcher keeps a rendezvous on --master-port, a lost node's generation ends, the "
                    "job re-forms with the nodes present (>= MIN) and the ranks restart from your checkpoint "
                    "(exit 3: fewer than MIN nodes within --rdzv-timeout; 4: node 0 unreachable; 5: a newer "
                    "launcher of this --node-rank joined while this one was frozen or cut off); default 1")
    lp.add_argument("--rdzv-timeout", type=float, default=120.0,
                    help="with --nnodes MIN:MAX: how long a forming generation waits for MIN nodes, and a node "
                         "for an unreachable node 0, in seconds; default 120")
    lp.add_argument("--node-rank", type=int, help="this host's node, 0..nnodes-1 (GROUP_RANK); needed with --nnodes > 1")
    lp.add_argument("--master-addr", help="address of node 0, where the job meets (MASTER_ADDR); default 127.0.0.1")
    lp.add_argument("--master-port", type=int, help="port on node 0 (MASTER_PORT); default: a free port (29500 "
                    "with --hosts or --emulate-network)")
    lp.add_argument("--emulate-network", metavar="RATE[,DELAY]",
                    help="run all --nnodes nodes here, each in a network namespace whose link is shaped "
                         "to RATE (e.g. 1gbit) and DELAY (e.g. 0.2ms, needs netem); needs root; default off")
    lp.add_argument("--config", help="TOML config handed to every rank (COMMRT_CONFIG); default none")
    lp.add_argument("--timeout", type=float, help="stop everything after this many seconds; default: no limit")
    lp.add_argument("--servers", type=int, default=0,
                    help="also start this many parameter-server shards on this host's loopback (COMMRT_PS_SERVERS is "
                         "set; one-node jobs only); default 0")
    lp.add_argument("--max-restarts", type=int, default=0, help="after a failure, restart the whole group this "
                    "many times (resume from your checkpoint); default 0")
    lp.add_argument("--curve", action="store_true",
                    help="authenticate every socket with CURVE, with throw-away keys for this job; default off")
    lp.add_argument("--hosts", metavar="FILE", help="run one node per line of FILE ('host [slots=N]') over ssh; "
                    "the first host is node 0; default: this host only")
    lp.add_argument("--ssh", default="ssh", help="the ssh command for --hosts (e.g. 'ssh -p 2222'); default ssh")
    lp.add_argument("cmd", nargs=argparse.REMAINDER, help="-- program and arguments")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="commrt launch", description="start N local ranks (torchrun-style environment)")
    add_arguments(p)
    return p


def run(args) -> int:
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        raise SystemExit("commrt launch: give the command to run after --")
    _check_numbers(args)
    for name in unknown_variables(os.environ):  # the ranks would ignore it without a word
        print(f"commrt launch: warning: {name} is set but no setting reads it (misspelt? 'commrt config "
              "--env-table' lists them all)", file=sys.stderr)
    env = dict(os.environ, COMMRT_SECURITY_MODE="curve") if args.curve else None
    try:
        return _run(args, cmd, env)
    except (FileNotFoundError, PermissionError) as exc:
        if exc.filename != cmd[0]:
            raise
        # the program itself: the shell's statuses (127 not found, 126 not executable), no traceback
        print(f"commrt launch: cannot start {cmd[0]!r}: {exc.strerror}", file=sys.stderr)
        return 127 if isinstance(exc, FileNotFoundError) else 126


def _check_numbers(args) -> None:
    """Out-of-range counts and durations as usage errors naming the option: -n 0 was a ValueError
    traceback, --max-restarts -1 an UnboundLocalError (no attempt ran), --servers -1 ignored."""
    for option, value, least in (("--nproc", args.nproc, 1), ("--max-restarts", args.max_restarts, 0),
                                 ("--servers", args.servers, 0)):
        if value < least:
            raise SystemExit(f"commrt launch: {option} {value} must be >= {least}")
    if args.master_port is not None and not 0 < args.master_port <= 65535:
        raise SystemExit(f"commrt launch: --master-port {args.master_port} must be a port number 1-65535")
    for option, value in (("--timeout", args.timeout), ("--rdzv-timeout", args.rdzv_timeout)):
        if value is not None and not 0 < value < float("inf"):
            raise SystemExit(f"commrt launch: {option} {value} must be a number of seconds > 0")


def _run(args, cmd, env) -> int:
    if ":" in args.nnodes:
        return _launch_elastic(args, cmd, env)
    args.nnodes = _count(args.nnodes)
    if args.hosts:
        return _launch_hosts(args, cmd, env)
    run_at = lambda nodes, port: launcher.launch(args.nproc, cmd, config=args.config, timeout_s=args.timeout,
                                                 servers=args.servers, env=env, max_restarts=args.max_restarts,
                                                 nodes=nodes, port=port)
    if args.emulate_network:
        from commrt import emulate
        if args.servers:
            raise SystemExit("commrt launch: --servers with --emulate-network is not supported "
                             "(the servers would sit outside the emulated nodes)")
        with emulate.cluster(args.nnodes, emulate.parse_shape(args.emulate_network)) as net:
            result = run_at(launcher.Nodes(args.nnodes, None, emulate.node_address(0), net.wrap),
                            args.master_port or 29500)
    else:
        result = run_at(_nodes(args), args.master_port)
    if result.returncode != 0:
        print(f"commrt launch: {result.describe()}", file=sys.stderr)
    return result.returncode


def _count(spec: str) -> int:
    try:
        return int(spec)
    except ValueError:
        raise SystemExit(f"commrt launch: --nnodes {spec!r} must be a number, or MIN:MAX for an elastic job") from None


def _launch_elastic(args, cmd, env) -> int:
    """--nnodes MIN:MAX: this host's node of an elastic job (runtime/elastic.py)."""
    from commrt.runtime.elastic import Policy, parse_nnodes
    try:
        lo, hi = parse_nnodes(args.nnodes)
    except ValueError as exc:
        raise SystemExit(f"commrt launch: {exc}") from None
    if args.hosts or args.emulate_network or args.servers:
        raise SystemExit("commrt launch: --nnodes MIN:MAX starts one node per launcher; it takes no --hosts, "
                         "--emulate-network or --servers (run one launcher per host, e.g. from deploy/slurm)")
    if args.node_rank is None or not args.master_addr or not args.master_port:
        raise SystemExit("commrt launch: --nnodes MIN:MAX needs --node-rank (this node's id, 0..MAX-1, unique), "
                         "--master-addr and --master-port (node 0's rendezvous) on every host")
    if not 0 <= args.node_rank < hi:
        raise SystemExit(f"commrt launch: --node-rank {args.node_rank} must be in 0..{hi - 1}")
    policy = Policy(lo, hi, join_timeout_s=args.rdzv_timeout, max_restarts=args.max_restarts)
    result = launch_elastic(args.nproc, cmd, policy, args.node_rank, args.master_addr, args.master_port,
                                     config=args.config, timeout_s=args.timeout, env=env)
    if result.returncode != 0:
        print(f"commrt launch: {result.failures[-1]}", file=sys.stderr)
    return result.returncode


def _launch_hosts(args, cmd, env) -> int:
    """--hosts FILE: one node per line of FILE, each started over ssh (commrt/deploy/ssh.py)."""
    from commrt.deploy.hostlist import parse_hostfile
    from commrt.deploy.ssh import launch_hosts
    if args.emulate_network or args.servers or args.node_rank is not None or args.nnodes != 1:
        raise SystemExit("commrt launch: --hosts sets the nodes itself; it takes no --nnodes, --node-rank, "
                         "--servers or --emulate-network (list the servers in [ps] servers)")
    try:
        with open(args.hosts) as fh:
            hosts = parse_hostfile(fh.read())
    except OSError as exc:
        raise SystemExit(f"commrt launch: cannot read the host file {args.hosts}: {exc.strerror}") from None
    extra = (["--config", os.path.abspath(args.config)] if args.config else []) + \
        (["--max-restarts", str(args.max_restarts)] if args.max_restarts else []) + (["--curve"] if args.curve else [])
    try:
        code = launch_hosts(hosts, args.nproc, cmd, args.master_port or 29500, args.ssh, args.master_addr, extra,
                            args.timeout, env)
    except (FileNotFoundError, PermissionError) as exc:  # the ssh command itself (hosts already started are stopped)
        raise SystemExit(f"commrt launch: cannot run --ssh {args.ssh!r}: {exc.strerror}") from None
    if code != 0:
        print(f"commrt launch: a host failed with exit code {code}; stopped every host", file=sys.stderr)
    return code


def _nodes(args) -> "launcher.Nodes":
    """This host's part of a multi-node job, as torchrun's --nnodes/--node-rank/--master-*."""
    if args.nnodes < 1:
        raise SystemExit(f"commrt launch: --nnodes {args.nnodes} must be >= 1")
    if args.nnodes == 1:
        return launcher.Nodes(1, 0, args.master_addr or "127.0.0.1")
    if args.node_rank is None or not args.master_addr or not args.master_port:
        raise SystemExit("commrt launch: --nnodes > 1 needs --node-rank, --master-addr and --master-port on every "
                         "host (or --emulate-network RATE to run every node on this one)")
    if args.servers:
        raise SystemExit(f"commrt launch: --servers with --nnodes {args.nnodes} would start shards on every host's "
                         "loopback, out of the other nodes' reach: start them with `commrt server --index I` and "
                         "list them in [ps] servers (deploy/README.md)")
    if not 0 <= args.node_rank < args.nnodes:
        raise SystemExit(f"commrt launch: --node-rank {args.node_rank} must be in 0..{args.nnodes - 1}")
    return launcher.Nodes(args.nnodes, args.node_rank, args.master_addr)


def guarded(command: str, fn, args) -> int:
    """``fn(args)``'s exit status, with commrt's errors, ^C and a stopping signal as statuses."""
    try:
        return fn(args)
    except CommError as exc:
        print(f"commrt {command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except launcher.Stopped as exc:  # SIGTERM/SIGHUP: everything launched has been stopped
        print(f"commrt {command}: {exc}; stopped every rank and server it started", file=sys.stderr)
        return 128 + exc.signum


def main(argv: list[str]) -> int:
    """``commrt launch ARGV`` in this process."""
    return guarded("launch", run, build_parser().parse_args(argv))
