"""``commrt node``: run one node of a job the way a scheduler placed it.

    commrt node slurm worker [--max-restarts K] -- python train.py   # one srun task per worker node
    commrt node slurm server [--resume]                             # one srun task per PS shard
    commrt node slurm rank -- python train.py                       # one srun task per rank
    commrt node k8s worker|server ...                               # a pod of the Job / StatefulSet
    commrt node attach -- LAUNCH-ARGS                               # the far end of launch --hosts

The scheduler's variables are mapped by ``commrt.deploy.plan`` (pure); this program only reads the
environment and becomes the resulting ``commrt launch`` / ``commrt server``: it runs it in this
process (one interpreter start fewer per node), so the scheduler's SIGTERM reaches the launcher,
which stops its ranks. ``--dry-run`` prints the command and the variables it adds (never the job
secret) instead.
"""
from __future__ import annotations

import argparse
import os
import shlex
import signal
import socket
import sys
import threading

from commrt.apps import launch_cmd
from commrt.apps import ps_server
from commrt.deploy import plan as P
from commrt.runtime.errors import ConfigError

MAPPERS = {"slurm": P.slurm_plan, "k8s": P.k8s_plan}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="commrt node", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("scheduler", choices=list(MAPPERS), help="whose variables describe the job: slurm or k8s")
    p.add_argument("role", nargs="?", choices=[*P.ROLES, "rank"], default="worker",
                   help="what this task runs: worker (a node of ranks), server (a PS shard) or rank "
                        "(SLURM: one task per rank); default worker")
    p.add_argument("--max-restarts", type=int, default=0, help="worker: commrt launch --max-restarts; default 0")
    p.add_argument("--resume", action="store_true", help="server: continue from [ps] checkpoint_dir; default off")
    p.add_argument("--dry-run", action="store_true", help="print what would run, run nothing; default off")
    return p


def resolve(args, program: list[str], environ) -> tuple[list[str], dict[str, str]]:
    """(argv to exec, variables to add) for this node; ``program``: what follows ``--``."""
    if args.role == "rank":
        if args.scheduler != "slurm":
            raise ConfigError("role 'rank' (one task per rank) is for SLURM only")
        if not program:
            raise ConfigError("give the program to run after --")
        return program, P.slurm_rank_env(environ)
    node = MAPPERS[args.scheduler](environ, args.role)
    extra = (["--resume"] if args.resume else []) if args.role == "server" else \
        (["--max-restarts", str(args.max_restarts)] if args.max_restarts else [])
    return node.command(sys.executable, program, extra), node.environ(environ)


def _attach(argv: list[str]) -> int:
    """Run ``commrt launch ARGS`` here with the job secret read from the first line of stdin (it
    never appears on a command line); stdin's end (the ssh connection dropped, or the launching
    side stopped us) is a SIGTERM to ourselves, which makes the launch stop its ranks."""
    secret = sys.stdin.readline().strip()
    if secret:
        os.environ[P.SECRET_NAME] = secret

    def watch() -> None:
        sys.stdin.read()  # returns at EOF
        os.kill(os.getpid(), signal.SIGTERM)
    threading.Thread(target=watch, daemon=True).start()
    return launch_cmd.main(argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["attach"]:  # everything after it belongs to commrt launch
        rest = argv[1:]
        return _attach(rest[1:] if rest[:1] == ["--"] else rest)
    cut = argv.index("--") if "--" in argv else len(argv)
    args = build_parser().parse_args(argv[:cut])
    try:
        # HOSTNAME: container runtimes set it; a shell may not export it
        environ = {"HOSTNAME": socket.gethostname(), **os.environ}
        command, added = resolve(args, argv[cut + 1:], environ)
    except ConfigError as exc:
        print(f"commrt node: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(" ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(added.items())), shlex.join(command))
        return 0
    os.environ.update(added)
    if args.role == "rank":  # the program itself, with torchrun's variables
        sys.stdout.flush()
        try:
            os.execvp(command[0], command)
        except OSError as exc:  # as a shell says it: 127 not found, 126 not executable
            print(f"commrt node: cannot start {command[0]!r}: {exc.strerror}", file=sys.stderr)
            return 127 if isinstance(exc, FileNotFoundError) else 126
    sub, rest = command[3], command[4:]  # [python, -m, commrt.cli, launch|server, ...]
    return launch_cmd.main(rest) if sub == "launch" else ps_server.main(rest)
