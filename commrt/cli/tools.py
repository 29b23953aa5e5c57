"""The small subcommands: keygen, server-status, flight-record, trace-merge, estimate."""
from __future__ import annotations

import os
import sys

from commrt.plan import command as estimate_command  # argparse and formulas: light until --measure runs


def _keygen(args) -> int:
    from commrt.transport.security import keygen
    if args.ranks < 1 or args.servers < 0:
        raise SystemExit(f"commrt keygen: -n {args.ranks} must be >= 1 and -s {args.servers} >= 0")
    names = [f"rank{r}" for r in range(args.ranks)] + [f"server{i}" for i in range(args.servers)]
    try:
        _key_directory(args.directory)
        keygen(args.directory, names)
    except OSError as exc:
        raise SystemExit(f"commrt keygen: cannot write the keys to {args.directory}: {exc.strerror or exc}") from None
    print(f"wrote {len(names)} key pairs (mode 0600) and allow.txt to {args.directory}; give every "
          f"process [security] mode = 'curve', keys_dir = '{args.directory}' (each reads only its own "
          ".key file: copy rank<r>.key to rank r's host only)")
    return 0


def _key_directory(directory: str) -> None:
    """Make ``directory`` (0700), or accept an existing one only if nobody but this user (and
    root) can write it (transport/key_modes.py: OpenSSH's StrictModes, a user-private group
    included): whoever can write there can swap allow.txt or a .key for their own, and so join
    the job or pose as one of its processes."""
    from commrt.transport import key_modes
    try:
        os.makedirs(directory, mode=0o700)
        return
    except FileExistsError:  # made here, not checked and then made: nobody can slip one in between
        pass
    why = key_modes.loose(os.stat(directory), os.geteuid())
    if why:
        raise SystemExit(f"commrt keygen: {directory} is {why}: they could replace the keys; give a new "
                         "directory (keygen makes it, mode 0700) or one only you can write")


def _server_status(args) -> int:
    import json

    from commrt.ps import PSClient
    from commrt.runtime.config import load_config
    client = PSClient(load_config(args.config), worker=0)
    try:
        print(json.dumps(client.stats(), indent=2))
    finally:
        client.close()
    return 0


def _estimate(args) -> int:
    out = estimate_command.render(args)
    if out is not None:  # None: a rank other than 0 of a --measure job
        if out.note:
            print(out.note, file=sys.stderr)
        print(out.text)
    return 0


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
    try:
        files = trace.rank_files(args.files)
    except OSError as exc:  # a template in a directory that does not exist
        raise SystemExit(f"commrt trace-merge: {exc}") from None
    if not files:
        raise SystemExit(f"commrt trace-merge: no trace files match {args.files}")
    try:
        trace.write(args.output, trace.merge(files))
    except (OSError, ValueError) as exc:
        raise SystemExit(f"commrt trace-merge: {exc}") from None
    print(f"merged {len(files)} rank traces into {args.output} (open it in https://ui.perfetto.dev)")
    return 0


def add_parsers(sub) -> None:
    kp = sub.add_parser("keygen", help="write CURVE key pairs and the allow-list for a job")
    kp.add_argument("directory", help="where the .key files and allow.txt go")
    kp.add_argument("-n", "--ranks", type=int, required=True, help="key pairs rank0..rank{n-1}; required")
    kp.add_argument("-s", "--servers", type=int, default=0, help="key pairs server0..server{s-1}")
    kp.set_defaults(fn=_keygen)
    tp = sub.add_parser("server-status", help="print every parameter server's counters as JSON")
    tp.add_argument("--config", help="TOML config naming the servers ([ps] servers); default: $COMMRT_CONFIG")
    tp.set_defaults(fn=_server_status)
    fp = sub.add_parser("flight-record", help="read every rank's flight record and say what happened")
    fp.add_argument("directory", help="the [log] flight_dir of the job")
    fp.add_argument("--world-size", type=int, help="ranks in the job; default: from the records")
    fp.add_argument("--json", action="store_true", help="findings and report as JSON")
    fp.set_defaults(fn=_flight_record)
    mp = sub.add_parser("trace-merge", help="join the ranks' trace files into one for ui.perfetto.dev")
    mp.add_argument("output", help="the merged trace file to write")
    mp.add_argument("files", nargs="+", help="the ranks' files, or the [log] trace_file template")
    mp.set_defaults(fn=_trace_merge)
    estimate_command.add_parser(sub).set_defaults(fn=_estimate)
