"""``commrt bench p2p``: point-to-point latency between ranks 0 and 1, per backend side by side.

    commrt bench p2p --backend zmq,gloo -b 4K -e 1M -f 4 -n 1000 [-w 50] [--json F]

Two figures per size, both one-way:

* ``pingpong``: rank 0 sends, rank 1 receives and sends the same bytes back; half the round
  trip (median of ``iters`` round trips, each timed alone).
* ``stream``: rank 0 sends ``iters`` messages back to back (each ``send`` returns before the
  next starts), rank 1 receives them and answers once at the end; the time per message.

Blocking ``isend(...).wait()`` / ``irecv(...).wait()`` on the backend, as a pipeline stage calls
them. Backends alternate size by size in the same processes (this machine is noisy). The last
round trip of each size is checked: rank 1 must have received, and rank 0 got back, exactly the
bytes rank 0 sent (#wrong counts differing elements). Ranks other than 0 and 1 only wait.
"""
from __future__ import annotations

import dataclasses
import os
import shlex
import statistics
import sys
import time

import torch

from commrt.bench import metrics, report, runner
from commrt.runtime.errors import ConfigError

TAG = 7


def run(args) -> int:
    """Called by ``commrt bench p2p`` (cli/bench_cmd.py) with its parsed options."""
    backends = tuple(b.strip() for b in args.backend.split(",") if b.strip())
    sizes = metrics.size_series(metrics.parse_size(args.minbytes), metrics.parse_size(args.maxbytes),
                                args.stepfactor)
    check(backends, sizes, args.iters, args.warmup)
    report.check_json_path(args.json)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if os.environ["WORLD_SIZE"].strip() == "1":  # rank 0 sent to a rank 1 that is not there
            raise ConfigError("commrt bench p2p times ranks 0 and 1: start it with 2 ranks or more (WORLD_SIZE=1)")
        return _rank(backends, sizes, args)
    from commrt import launch as launcher
    cmd = [sys.executable, "-m", "commrt.cli", "bench", *_words(args)]
    result = launcher.launch(max(2, args.nproc), cmd, prefix=False)
    if result.returncode != 0:
        print(f"commrt bench p2p: {result.describe()}", file=sys.stderr)
    return result.returncode


def _words(args) -> list[str]:
    """The words after ``bench`` (cli/bench_cmd.bench_words: the argv commrt.cli.main was given)."""
    argv = getattr(args, "argv", None) or sys.argv
    return list(argv[argv.index("bench") + 1:]) if "bench" in argv else []


BACKENDS = ("zmq", "gloo", "nccl")


def check(backends: tuple[str, ...], sizes: list[int], iters: int, warmup: int) -> None:
    """Before any rank starts (ConfigError, one line from the CLI): -n 0 took the median of no
    round trips and divided the stream by zero on rank 0 after the start-up; an unknown backend
    failed on every rank; a size under 4 B sent no float32 element yet was reported as its size."""
    bad = [b for b in backends if b not in BACKENDS]
    if not backends or bad:
        raise ConfigError(f"commrt bench p2p: --backend {','.join(backends)!r}: valid: {list(BACKENDS)}")
    if len(set(backends)) < len(backends):  # a second world in the same namespace: "duplicate rank"
        raise ConfigError(f"commrt bench p2p: --backend {','.join(backends)!r} names a backend twice")
    if iters < 1 or warmup < 0:
        raise ConfigError(f"need iters >= 1 and warmup >= 0, got -n {iters}, -w {warmup}")
    if sizes[0] < 4:
        raise ConfigError(f"commrt bench p2p sends float32 elements: -b {sizes[0]} is under 4 bytes")


def pingpong(be, rank: int, buf: torch.Tensor, iters: int) -> list[float]:
    """Half round trips (seconds) seen by rank 0; rank 1 echoes."""
    out = []
    for _ in range(iters):
        if rank == 0:
            start = time.perf_counter()
            be.isend(buf, 1, TAG).wait()
            be.irecv(buf, 1, TAG).wait()
            out.append((time.perf_counter() - start) / 2)
        elif rank == 1:
            be.irecv(buf, 0, TAG).wait()
            be.isend(buf, 0, TAG).wait()
    return out


def stream(be, rank: int, buf: torch.Tensor, ack: torch.Tensor, iters: int) -> float:
    """Seconds per message of ``iters`` one-way messages, rank 0's clock (until rank 1's answer)."""
    start = time.perf_counter()
    if rank == 0:
        for _ in range(iters):
            be.isend(buf, 1, TAG).wait()
        be.irecv(ack, 1, TAG + 1).wait()
    elif rank == 1:
        for _ in range(iters):
            be.irecv(buf, 0, TAG).wait()
        be.isend(ack, 0, TAG + 1).wait()
    return (time.perf_counter() - start) / iters


def checked_round_trip(be, rank: int, sent: torch.Tensor) -> torch.Tensor:
    """Rank 0 sends ``sent``, rank 1 echoes it: what rank 1 received, and what came back to
    rank 0, each in a buffer of NaN first. Rank 0 used to receive into the buffer it sent
    from, already holding ``sent``: the way back was never checked (and rank 1's buffer of
    -1.0 matched the pattern's -1 elements)."""
    echo = torch.full_like(sent, float("nan"))
    if rank == 0:
        be.isend(sent, 1, TAG).wait()
        be.irecv(echo, 1, TAG).wait()
    elif rank == 1:
        be.irecv(echo, 0, TAG).wait()
        be.isend(echo, 0, TAG).wait()
    return echo


def measure(be, rank: int, nbytes: int, iters: int, warmup: int) -> dict:
    sent = runner.pattern(nbytes // 4, 0, torch.float32, runner.parse_op("sum"))
    buf, ack = sent.clone(), torch.zeros(1)
    pingpong(be, rank, buf, warmup)
    be.barrier(False)
    halves = pingpong(be, rank, buf, iters)
    be.barrier(False)
    per_msg = stream(be, rank, buf, ack, iters)
    be.barrier(False)
    echo = checked_round_trip(be, rank, sent)
    wrong = torch.tensor([metrics.count_wrong(echo, sent) if rank in (0, 1) else 0], dtype=torch.int64)
    be.all_reduce(wrong, runner.ReduceOp.SUM, False)
    row = {"size": nbytes, "wrong": int(wrong[0]), "stream_us": per_msg * 1e6}
    if rank == 0:
        row |= {"pingpong_us": statistics.median(halves) * 1e6,
                "pingpong_p90_us": sorted(halves)[int(0.9 * (len(halves) - 1))] * 1e6}
    return row


def _rank(backends: tuple[str, ...], sizes: list[int], args) -> int:
    from commrt.runtime import bootstrap, rendezvous
    from commrt.runtime.config import load_config
    from commrt.transport.transport import Transport
    rdzv = rendezvous.resolve("env://", None, None, os.environ)
    cfg = load_config()
    transport = Transport(cfg, f"rank{rdzv.rank}")
    store, server = bootstrap.open_store(transport, rdzv, cfg.comm.timeout_s)
    runtimes = {}
    try:
        for name in backends:
            comm = dataclasses.replace(cfg.comm, backend=name)
            runtimes[name] = bootstrap.init_world(dataclasses.replace(cfg, comm=comm), rdzv,
                                                  store=(store, None), namespace=f"{name}/")
        rows = []
        for nbytes in sizes:
            rows.append({name: measure(rt.world.backend, rdzv.rank, nbytes, args.iters, args.warmup)
                         for name, rt in runtimes.items()})
    finally:
        for rt in runtimes.values():
            bootstrap.shutdown(rt, keep_store=True)
        store.close()
        if server is not None:
            server.close()
        transport.close()
    if rdzv.rank == 0:
        command = "commrt bench " + shlex.join(_words(args))
        print(table(backends, rows, rdzv.world_size, args.iters), flush=True)
        if args.json:
            report.write_json(args.json, {"benchmark": "p2p", "command": command, "nproc": rdzv.world_size,
                                          "iters": args.iters, "warmup": args.warmup, "backends": list(backends),
                                          "rows": rows})
    return 1 if any(r[b]["wrong"] for r in rows for b in backends) else 0


def table(backends: tuple[str, ...], rows: list[dict], nproc: int, iters: int) -> str:
    first = backends[0]
    head = f"#{'size':>10}" + "".join(f" {n + ' pingpong':>16} {'p90':>8} {'stream':>9} {'#wrong':>6}"
                                      for n in backends)
    head += "".join(f" {'ratio ' + n:>14}" for n in backends[1:])
    lines = [f"# commrt bench p2p: ranks 0 <-> 1 of {nproc}, float32, iters {iters}; one-way latency in us",
             "# pingpong: half a round trip (median); stream: per message of a back-to-back stream",
             head]
    for row in rows:
        line = f" {row[first]['size']:>10}"
        for n in backends:
            r = row[n]
            line += f" {r['pingpong_us']:>16.1f} {r['pingpong_p90_us']:>8.1f} {r['stream_us']:>9.1f} {r['wrong']:>6}"
        for n in backends[1:]:  # > 1: the first backend is faster
            line += f" {row[n]['pingpong_us'] / row[first]['pingpong_us']:>14.2f}"
        lines.append(line)
    lines.append(f"# ratio NAME = NAME's pingpong / {first}'s (> 1: {first} is faster)")
    return "\n".join(lines)
