"""The ``commrt`` command: launch, bench, config, server, server-status, keygen, node,
flight-record, trace-merge, estimate."""
from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import sys

from commrt import launch as launcher
from commrt.runtime.errors import CommError

PROGRESS = "#progress "


def _launch(args) -> int:
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        raise SystemExit("commrt launch: give the command to run after --")
    env = dict(os.environ, COMMRT_SECURITY_MODE="curve") if args.curve else None
    if args.hosts:
        return _launch_hosts(args, cmd, env)
    run = lambda nodes, port: launcher.launch(args.nproc, cmd, config=args.config, timeout_s=args.timeout,
                                              servers=args.servers, env=env, max_restarts=args.max_restarts,
                                              nodes=nodes, port=port)
    if args.emulate_network:
        from commrt import emulate
        if args.servers:
            raise SystemExit("commrt launch: --servers with --emulate-network is not supported "
                             "(the servers would sit outside the emulated nodes)")
        with emulate.cluster(args.nnodes, emulate.parse_shape(args.emulate_network)) as net:
            result = run(launcher.Nodes(args.nnodes, None, emulate.node_address(0), net.wrap),
                         args.master_port or 29500)
    else:
        result = run(_nodes(args), args.master_port)
    if result.returncode != 0:
        print(f"commrt launch: {result.describe()}", file=sys.stderr)
    return result.returncode


def _launch_hosts(args, cmd, env) -> int:
    """--hosts FILE: one node per line of FILE, each started over ssh (commrt/deploy/ssh.py)."""
    from commrt.deploy.hostlist import parse_hostfile
    from commrt.deploy.ssh import launch_hosts
    if args.emulate_network or args.servers or args.node_rank is not None or args.nnodes != 1:
        raise SystemExit("commrt launch: --hosts sets the nodes itself; it takes no --nnodes, --node-rank, "
                         "--servers or --emulate-network (list the servers in [ps] servers)")
    with open(args.hosts) as fh:
        hosts = parse_hostfile(fh.read())
    extra = (["--config", os.path.abspath(args.config)] if args.config else []) + \
        (["--max-restarts", str(args.max_restarts)] if args.max_restarts else []) + (["--curve"] if args.curve else [])
    code = launch_hosts(hosts, args.nproc, cmd, args.master_port or 29500, args.ssh, args.master_addr, extra,
                        args.timeout, env)
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
    if not 0 <= args.node_rank < args.nnodes:
        raise SystemExit(f"commrt launch: --node-rank {args.node_rank} must be in 0..{args.nnodes - 1}")
    return launcher.Nodes(args.nnodes, args.node_rank, args.master_addr)


class _ProgressOut:
    """Shows the ranks' ``#progress`` lines in place on a terminal; passes everything else."""

    def __init__(self, stream):
        self.stream, self.tty, self.dirty = stream, stream.isatty(), False

    def write(self, text: str) -> None:
        if text.startswith(PROGRESS):
            if self.tty:
                self.stream.write("\r\033[K" + text[len(PROGRESS):].rstrip("\n"))
                self.dirty = True
            return
        if self.dirty:
            self.stream.write("\r\033[K")
            self.dirty = False
        self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


def _bench(args) -> int:
    from commrt.bench import metrics
    from commrt.bench.runner import BenchSpec
    backends = tuple(b.strip() for b in args.backend.split(",") if b.strip())
    if args.quant:
        from commrt.bench.quant import with_quant
        backends = with_quant(backends, args.quant)
    spec = BenchSpec(args.collective, backends, metrics.parse_size(args.minbytes),
                     metrics.parse_size(args.maxbytes), args.stepfactor, args.iters, args.warmup,
                     args.datatype, args.op, args.physical, args.mode, args.input)
    metrics.size_series(spec.min_bytes, spec.max_bytes, spec.factor)  # validate before launching
    if args.plot and importlib.util.find_spec("matplotlib") is None:  # not after the whole run
        raise SystemExit("commrt bench: --plot needs matplotlib: pip install matplotlib")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _bench_rank(spec, args)
    cmd = [sys.executable, "-m", "commrt.cli", "bench", *sys.argv[sys.argv.index("bench") + 1:]]
    result = launcher.launch(args.nproc, cmd, out=_ProgressOut(sys.stdout), prefix=False)
    if result.returncode != 0:
        print(f"commrt bench: {result.describe()}", file=sys.stderr)
    return result.returncode


def _bench_rank(spec, args) -> int:
    from commrt.bench import report, runner
    rank, nproc = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    progress = (lambda msg: print(PROGRESS + msg, flush=True)) if rank == 0 else None
    traffic: dict = {}
    rows = runner.run(spec, progress, traffic=traffic)
    if rank == 0:
        print(report.table(spec, nproc, rows), flush=True)
        for name, t in traffic.items():  # all ranks, the whole run (warm-up and checks included)
            print(f"# {name}: sent inside nodes {t['intra_node_bytes']} B, across nodes "
                  f"{t['inter_node_bytes']} B" + (f"; {t['quant']}" if "quant" in t else ""), flush=True)
        command = "commrt bench " + shlex.join(sys.argv[sys.argv.index("bench") + 1:])
        if args.json:
            report.write_json(args.json, report.to_json(spec, nproc, rows, command))
        if args.plot:
            report.plot(args.plot, spec, nproc, rows)
    wrong = sum(r[b]["wrong"] for r in rows for b in spec.backends)
    return 1 if wrong else 0


def _keygen(args) -> int:
    from commrt.transport.security import keygen
    names = [f"rank{r}" for r in range(args.ranks)] + [f"server{i}" for i in range(args.servers)]
    keygen(args.directory, names)
    print(f"wrote {len(names)} key pairs (mode 0600) and allow.txt to {args.directory}; give every "
          f"process [security] mode = 'curve', keys_dir = '{args.directory}' (each reads only its own "
          ".key file: copy rank<r>.key to rank r's host only)")
    return 0


def _server_status(args) -> int:
    import json

    from commrt.runtime.config import load_config
    from commrt.ps import PSClient
    client = PSClient(load_config(args.config), worker=0)
    try:
        print(json.dumps(client.stats(), indent=2))
    finally:
        client.close()
    return 0


def _estimate(args) -> int:
    from commrt.plan import command as estimate_command
    out = estimate_command.render(args)
    if out is not None:  # None: a rank other than 0 of a --measure job
        if out.note:
            print(out.note, file=sys.stderr)
        print(out.text)
    return 0


def _config(args) -> int:
    from commrt.runtime.config import env_table, load_config
    if args.env_table:
        print("| variable | default | setting |\n|---|---|---|")
        for var, default, meaning in env_table():
            print(f"| `{var}` | `{default}` | {meaning} |")
        return 0
    cfg = load_config(args.file)
    for section in ("comm", "cluster", "security", "ps"):
        print(f"[{section}]")
        for key, value in vars(getattr(cfg, section)).items():
            print(f"{key} = {value!r}")
    print(f"# digest {cfg.digest()}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="commrt", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    lp = sub.add_parser("launch", help="start N local ranks (torchrun-style environment)")
    lp.add_argument("-n", "--nproc", "--nproc-per-node", type=int, required=True)
    lp.add_argument("--nnodes", type=int, default=1, help="nodes in the job (torchrun's --nnodes)")
    lp.add_argument("--node-rank", type=int, help="this host's node, 0..nnodes-1 (GROUP_RANK)")
    lp.add_argument("--master-addr", help="address of node 0, where the job meets (MASTER_ADDR)")
    lp.add_argument("--master-port", type=int, help="port on node 0 (MASTER_PORT)")
    lp.add_argument("--emulate-network", metavar="RATE[,DELAY]",
                    help="run all --nnodes nodes here, each in a network namespace whose link is shaped "
                         "to RATE (e.g. 1gbit) and DELAY (e.g. 0.2ms, needs netem); needs root")
    lp.add_argument("--config", help="TOML config handed to every rank (COMMRT_CONFIG)")
    lp.add_argument("--timeout", type=float, help="stop everything after this many seconds")
    lp.add_argument("--servers", type=int, default=0,
                    help="also start this many parameter-server shards (COMMRT_PS_SERVERS is set)")
    lp.add_argument("--max-restarts", type=int, default=0,
                    help="after a failure, restart the whole group this many times (resume from your checkpoint)")
    lp.add_argument("--curve", action="store_true",
                    help="authenticate every socket with CURVE, with throw-away keys for this job")
    lp.add_argument("--hosts", metavar="FILE",
                    help="run one node per line of FILE ('host [slots=N]') over ssh; the first host is node 0")
    lp.add_argument("--ssh", default="ssh", help="the ssh command for --hosts (e.g. 'ssh -p 2222')")
    lp.add_argument("cmd", nargs=argparse.REMAINDER, help="-- program and arguments")
    lp.set_defaults(fn=_launch)

    bp = sub.add_parser("bench", help="nccl-tests-style bandwidth benchmark")
    bp.add_argument("collective", choices=["all_reduce", "reduce_scatter", "all_gather", "broadcast",
                                           "reduce", "all_to_all", "sendrecv", "ps"])
    bp.add_argument("--backend", default="zmq", help="zmq|gloo|nccl or a comma list (interleaved); "
                    "NAME+hier: NAME with the hierarchical collectives (needs a multi-node launch)")
    bp.add_argument("--nproc", type=int, default=2, help="local ranks to start (ignored under a launcher)")
    bp.add_argument("-b", "--minbytes", default="4K")
    bp.add_argument("-e", "--maxbytes", default="64M")
    bp.add_argument("-f", "--stepfactor", type=float, default=2.0)
    bp.add_argument("-n", "--iters", type=int, default=20)
    bp.add_argument("-w", "--warmup", type=int, default=5)
    bp.add_argument("-d", "--datatype", default="float32")
    bp.add_argument("-o", "--op", default="sum")
    bp.add_argument("--physical", action="store_true",
                    help="also measure the raw TCP ring ceiling and this host's memcpy / reduction bandwidth")
    bp.add_argument("--mode", choices=["both", "back-to-back", "alone"], default="both",
                    help="back-to-back: a loop of ops, timed as a whole (nccl-tests); alone: each op timed on "
                         "its own after rewriting its input and a barrier, as a training step calls it "
                         "(median of the slowest rank); both (default): side by side")
    bp.add_argument("--input", choices=["torch", "numpy"], default="torch",
                    help="hand the collectives torch tensors or numpy arrays")
    bp.add_argument("--quant", help="int8,int4: also the quantized all_reduce / reduce_scatter / all_gather "
                    "of the first backend (busbw over the unquantized bytes)")
    bp.add_argument("--json", help="write all results to this file")
    bp.add_argument("--plot", help="draw busbw against size to this PNG (needs matplotlib)")
    bp.set_defaults(fn=_bench)

    sub.add_parser("server", help="run one parameter-server shard: --config F --index I [--resume]")
    sub.add_parser("node", help="run this node of a SLURM / Kubernetes job: commrt node slurm|k8s worker|server -- ...")
    kp = sub.add_parser("keygen", help="write CURVE key pairs and the allow-list for a job")
    kp.add_argument("directory")
    kp.add_argument("-n", "--ranks", type=int, required=True, help="key pairs rank0..rank{n-1}")
    kp.add_argument("-s", "--servers", type=int, default=0, help="key pairs server0..server{s-1}")
    kp.set_defaults(fn=_keygen)
    tp = sub.add_parser("server-status", help="print every parameter server's counters as JSON")
    tp.add_argument("--config")
    tp.set_defaults(fn=_server_status)

    cp = sub.add_parser("config", help="validate a config file and print the resolved settings")
    cp.add_argument("file", nargs="?")
    cp.add_argument("--env-table", action="store_true", help="print the environment variable table")
    cp.set_defaults(fn=_config)
    _add_obs_commands(sub)
    from commrt.plan import command as estimate_command  # pure until --measure
    estimate_command.add_parser(sub).set_defaults(fn=_estimate)
    return p


def _flight_record(args) -> int:
    from commrt.obs.analyze import analyze
    from commrt.obs.flight import read_dumps
    try:
        dumps = read_dumps(args.directory)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"commrt flight-record: {exc}") from None
    if not dumps:
        raise SystemExit(f"commrt flight-record: no rank*.json flight records in {args.directory}")
    findings, lines = analyze(dumps, args.world_size)
    if args.json:
        import dataclasses
        import json
        print(json.dumps({"findings": [dataclasses.asdict(f) for f in findings], "report": lines}, indent=1))
    else:
        print("\n".join(lines))
    return 0


def _trace_merge(args) -> int:
    from commrt.obs import trace
    files = trace.rank_files(args.files)
    if not files:
        raise SystemExit(f"commrt trace-merge: no trace files match {args.files}")
    try:
        trace.write(args.output, trace.merge(files))
    except (OSError, ValueError) as exc:
        raise SystemExit(f"commrt trace-merge: {exc}") from None
    print(f"merged {len(files)} rank traces into {args.output} (open it in https://ui.perfetto.dev)")
    return 0


def _add_obs_commands(sub) -> None:
    fp = sub.add_parser("flight-record", help="read every rank's flight record and say what happened")
    fp.add_argument("directory", help="the [log] flight_dir of the job")
    fp.add_argument("--world-size", type=int, help="ranks in the job (default: from the records)")
    fp.add_argument("--json", action="store_true", help="findings and report as JSON")
    fp.set_defaults(fn=_flight_record)
    mp = sub.add_parser("trace-merge", help="join the ranks' trace files into one for ui.perfetto.dev")
    mp.add_argument("output")
    mp.add_argument("files", nargs="+", help="the ranks' files, or the [log] trace_file template")
    mp.set_defaults(fn=_trace_merge)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["server"]:  # its own parser, shared with python -m servers.ps
        from commrt.apps.ps_server import main as server_main
        return server_main(argv[1:])
    if argv[:1] == ["node"]:  # a scheduler's node: its own parser (commrt/apps/node.py)
        from commrt.apps.node import main as node_main
        return node_main(argv[1:])
    if argv[:2] == ["bench", "ps"]:  # -w means workers here, not warmup as in nccl-tests
        from commrt.bench.ps import main as bench_ps
        return bench_ps(argv[2:])
    if argv[:2] == ["bench", "train"]:  # plain torch loop vs the engine's stages (commrt/bench/train.py)
        from commrt.bench.train import main as bench_train
        return bench_train(argv[2:])
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except CommError as exc:
        print(f"commrt {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except launcher.Stopped as exc:  # SIGTERM/SIGHUP: everything launched has been stopped
        print(f"commrt {args.command}: {exc}; stopped every rank and server it started", file=sys.stderr)
        return 128 + exc.signum


if __name__ == "__main__":
    sys.exit(main())
