"""The ``commrt`` command: launch, bench, config, server, server-status, keygen, node,
flight-record, trace-merge, estimate.

Each subcommand's code lives beside this file (bench_cmd, config_cmd, tools) or below the CLI
(apps/launch_cmd.py, shared with ``commrt node``); building the parser imports none of it, so
``--help`` answers at once.
"""
from __future__ import annotations

import argparse
import sys

from commrt.apps import launch_cmd
from commrt.cli import bench_cmd, config_cmd, tools

DESCRIPTION = """\
commrt: a communication runtime for distributed training. Subcommands:
  launch         start N local ranks (torchrun-style environment)
  bench          nccl-tests-style bandwidth benchmark (bench ps: the parameter server's)
  config         print the effective config as TOML, each value with its source
  server         run one parameter-server shard: --config F --index I [--resume]
  server-status  print every parameter server's counters as JSON
  node           run this node of a SLURM / Kubernetes job
  keygen         write CURVE key pairs and the allow-list for a job
  flight-record  read every rank's flight record and say what happened
  trace-merge    join the ranks' trace files into one for ui.perfetto.dev
  estimate       predict memory and time per step for a training configuration
Run 'commrt SUBCOMMAND --help' for its options."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="commrt", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND")
    lp = sub.add_parser("launch", help="start N local ranks (torchrun-style environment)",
                        description="start N local ranks (torchrun-style environment)")
    launch_cmd.add_arguments(lp)
    lp.set_defaults(fn=launch_cmd.run)
    bench_cmd.add_parser(sub)
    config_cmd.add_parser(sub)
    sub.add_parser("server", help="run one parameter-server shard: --config F --index I [--resume]", add_help=False)
    sub.add_parser("node", help="run this node of a SLURM / Kubernetes job: commrt node slurm|k8s worker|server -- ...",
                   add_help=False)
    tools.add_parsers(sub)
    for parser in sub.choices.values():
        _show_defaults(parser)
    return p


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """Every option's help ends with its default, unless it already names one."""
    for action in parser._actions:
        if action.help and action.default not in (None, False, argparse.SUPPRESS) and "default" not in action.help:
            action.help += " (default: %(default)s)"


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
    args.argv = argv  # what bench relaunches under commrt launch: these words, not sys.argv's
    return launch_cmd.guarded(args.command, args.fn, args)


if __name__ == "__main__":
    sys.exit(main())
