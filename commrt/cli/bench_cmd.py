"""``commrt bench``: the nccl-tests-style benchmark. Started plainly, it checks its options,
then relaunches itself under ``commrt launch``; under a launcher (RANK set) it is one rank."""
from __future__ import annotations

import importlib.util
import os
import shlex
import sys

from commrt import launch as launcher

PROGRESS = "#progress "
BACKENDS = ("zmq", "gloo", "nccl")
VARIANTS = ("", "hier", "int8", "int4")  # NAME+hier, NAME+int8 / +int4 (bench/runner.py)
COLLECTIVES = ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all", "sendrecv", "ps", "p2p", "train"]


def add_parser(sub) -> None:
    bp = sub.add_parser("bench", help="nccl-tests-style bandwidth benchmark",
                        description="nccl-tests-style bandwidth benchmark: busbw per size, per backend")
    bp.add_argument("collective", choices=COLLECTIVES, help="what to time ('bench ps --help': the PS benchmark; 'bench train --help': training step time per strategy)")
    bp.add_argument("--backend", default="zmq", help="zmq|gloo|nccl or a comma list (interleaved); "
                    "NAME+hier: NAME with the hierarchical collectives (needs a multi-node launch); "
                    "NAME@SIZE: NAME with [comm] chunk_bytes = SIZE")
    bp.add_argument("--algo", help="schedules to measure, each as its own column over TCP (a comma list, or "
                    "'all'): e.g. recursive_doubling,rabenseifner,ring for all_reduce; each column is the first "
                    "plain zmq (or zmq@SIZE) --backend with [comm] algorithms pinning it and intra_node = tcp; "
                    "default: the table's choice")
    bp.add_argument("--nproc", type=int, default=2, help="local ranks to start (ignored under a launcher)")
    bp.add_argument("-b", "--minbytes", default="4K", help="smallest payload per rank (K, M, G suffixes)")
    bp.add_argument("-e", "--maxbytes", default="64M", help="largest payload per rank")
    bp.add_argument("-f", "--stepfactor", type=float, default=2.0, help="each size is the last times this")
    bp.add_argument("-n", "--iters", type=int, default=20, help="timed iterations per size")
    bp.add_argument("-w", "--warmup", type=int, default=5, help="untimed iterations per size first")
    bp.add_argument("-d", "--datatype", default="float32", help="element type (float32, float16, bfloat16, int32, ...)")
    bp.add_argument("-o", "--op", default="sum", help="reduction: sum, prod, min, max, avg")
    bp.add_argument("--physical", action="store_true",
                    help="also measure the raw TCP ring ceiling and this host's memcpy / reduction bandwidth")
    bp.add_argument("--mode", choices=["both", "back-to-back", "alone"], default="both",
                    help="back-to-back: a loop of ops, timed as a whole (nccl-tests); alone: each op timed on "
                         "its own after rewriting its input and a barrier, as a training step calls it "
                         "(median of the slowest rank); both: side by side")
    bp.add_argument("--input", choices=["torch", "numpy"], default="torch",
                    help="hand the collectives torch tensors or numpy arrays; default: torch")
    bp.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cuda: every backend's tensors (and the quantized codec) on this rank's GPU; default: cpu")
    bp.add_argument("--quant", help="int8,int4: also the quantized all_reduce / reduce_scatter / all_gather "
                    "of the first backend (busbw over the unquantized bytes); default: none")
    bp.add_argument("--json", help="write all results to this file; default: none")
    bp.add_argument("--plot", help="draw busbw against size to this PNG (needs matplotlib); default: none")
    bp.set_defaults(fn=run)


def check_backends(names: tuple[str, ...], collective: str | None = None) -> None:
    """Refuse a misspelt backend before any rank starts (not after 16 s of start-up), and a
    ``:ALGO`` (bench/runner.py pins it through [comm] algorithms, which only zmq reads) on
    another backend or naming a schedule ``collective`` does not have."""
    from commrt.bench import metrics
    from commrt.collectives.schedules import ALGORITHMS
    if not names:
        raise SystemExit(f"commrt bench: --backend is empty; valid: {list(BACKENDS)}")
    for name in names:
        base, _, variant = name.partition("+")
        head, _, algo = base.partition(":")
        backend, _, chunk = head.partition("@")
        if backend not in BACKENDS or variant not in VARIANTS:
            raise SystemExit(f"commrt bench: --backend {name!r} is invalid; valid: {list(BACKENDS)}, each "
                             "optionally with +hier, +int8, +int4 or @CHUNK_SIZE")
        if chunk:
            metrics.parse_size(chunk)
        if algo and backend != "zmq":
            raise SystemExit(f"commrt bench: --backend {name!r}: only zmq runs a pinned schedule (:{algo})")
        valid = sorted(ALGORITHMS.get(collective or "", {}))
        if algo and collective is not None and algo not in valid:
            raise SystemExit(f"commrt bench: --backend {name!r}: no schedule {algo!r}; valid for {collective}: "
                             f"{valid or 'none'}")


def bench_words(args) -> list[str]:
    """The words after ``bench`` of this command: from ``commrt.cli.main(argv)``'s argv (a
    program calling it with a list had sys.argv's, with no 'bench': a ValueError traceback)."""
    argv = getattr(args, "argv", None) or sys.argv
    return list(argv[argv.index("bench") + 1:]) if "bench" in argv else []


def _check_counts(args) -> None:
    """--nproc 0 was launch()'s ValueError traceback, -n 0 a ZeroDivisionError in every rank."""
    for option, value, least in (("--nproc", args.nproc, 1), ("--iters", args.iters, 1), ("--warmup", args.warmup, 0)):
        if value < least:
            raise SystemExit(f"commrt bench: {option} {value} must be >= {least}")


def with_algorithms(backends: tuple[str, ...], collective: str, algo: str) -> tuple[str, ...]:
    """``--algo``: one ``zmq:ALGO`` column per schedule (bench/runner.py pins it), after the other
    backends; refuses a name the collective has no schedule for, listing those it has."""
    from commrt.collectives.schedules import ALGORITHMS
    valid = sorted(ALGORITHMS.get(collective, {}))
    names = valid if algo.strip() == "all" else [a.strip() for a in algo.split(",") if a.strip()]
    bad = [a for a in names if a not in valid]
    if bad or not names:
        raise SystemExit(f"commrt bench: --algo {algo!r} is invalid for {collective}; valid: {valid or 'none'} or 'all'")
    # a plain zmq column (or zmq@CHUNK): a '+hier' / '+int8' one keeps its own column, since
    # 'zmq+hier:ring' was neither (runner reads the schedule before the '+', the variant at the end)
    zmq = next((b for b in backends if "+" not in b and b.partition("@")[0] == "zmq"), "zmq")
    return tuple(b for b in backends if b != zmq) + tuple(f"{zmq}:{a}" for a in names)


# what bench p2p reads of the options (float32 messages, its own table): the others it ignored,
# silently (--plot drew nothing, -d float16 timed float32)
P2P_OPTIONS = {"command", "collective", "fn", "argv", "backend", "nproc", "minbytes", "maxbytes", "stepfactor", "iters",
               "warmup", "json"}


def _check_p2p(args) -> None:
    defaults = build_defaults()
    ignored = sorted(k for k, v in vars(args).items() if k not in P2P_OPTIONS and v != defaults.get(k))
    if ignored:
        raise SystemExit(f"commrt bench p2p: {', '.join('--' + k for k in ignored)} do not apply to p2p (float32 "
                         "messages between ranks 0 and 1); it takes --backend, --nproc, -b, -e, -f, -n, -w, --json")


def build_defaults() -> dict:
    """Every ``commrt bench`` option's default."""
    import argparse
    sub = argparse.ArgumentParser().add_subparsers()
    add_parser(sub)
    return {a.dest: a.default for a in sub.choices["bench"]._actions}


def run(args) -> int:
    if args.collective == "p2p":  # point-to-point latency (bench/p2p.py): its own rows and table
        from commrt.bench.p2p import run as run_p2p
        _check_p2p(args)
        return run_p2p(args)
    from commrt.bench import metrics, report
    from commrt.bench.runner import BenchSpec
    _check_counts(args)
    backends = tuple(b.strip() for b in args.backend.split(",") if b.strip())
    check_backends(backends, args.collective)
    if args.algo:
        backends = with_algorithms(backends, args.collective, args.algo)
    if args.quant:
        from commrt.bench.quant import with_quant
        backends = with_quant(backends, args.quant)
    try:  # validate before launching: a bad size or factor was a ValueError traceback
        spec = BenchSpec(args.collective, backends, metrics.parse_size(args.minbytes),
                         metrics.parse_size(args.maxbytes), args.stepfactor, args.iters, args.warmup,
                         args.datatype, args.op, args.physical, args.mode, args.input, args.device)
        metrics.size_series(spec.min_bytes, spec.max_bytes, spec.factor)
        report.check_json_path(args.json)
    except ValueError as exc:
        raise SystemExit(f"commrt bench: {exc}") from None
    if args.plot and importlib.util.find_spec("matplotlib") is None:  # not after the whole run
        raise SystemExit("commrt bench: --plot needs matplotlib: pip install -e '.[plot]' "
                         "(or pip install matplotlib)")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _rank(spec, args)
    cmd = [sys.executable, "-m", "commrt.cli", "bench", *bench_words(args)]
    result = launcher.launch(args.nproc, cmd, out=_ProgressOut(sys.stdout), prefix=False)
    if result.returncode != 0:
        print(f"commrt bench: {result.describe()}", file=sys.stderr)
    return result.returncode


def _rank(spec, args) -> int:
    from commrt.bench import report, runner
    rank, nproc = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    progress = (lambda msg: print(PROGRESS + msg, flush=True)) if rank == 0 else None
    traffic: dict = {}
    rows = runner.run(spec, progress, traffic=traffic)
    if rank == 0:
        print(report.table(spec, nproc, rows), flush=True)
        print(report.traffic_lines(traffic), flush=True)  # all ranks, the whole run
        command = "commrt bench " + shlex.join(bench_words(args))
        if args.json:
            report.write_json(args.json, report.to_json(spec, nproc, rows, command))
        if args.plot:
            print(f"# plot: {report.plot(args.plot, spec, nproc, rows)}", flush=True)
    wrong = sum(r[b]["wrong"] for r in rows for b in spec.backends)
    return 1 if wrong else 0


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
