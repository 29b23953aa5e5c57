"""``commrt bench ps``: parameter-server push+pull against an allreduce of the same bytes, over
the same worker ranks, in one run (the classic PS-versus-ring comparison).

    commrt bench ps -w 4 -s 2 --params 64K,1M,16M [-n 20] [--warmup 5] [--json F]

Each worker pushes a float32 gradient of P bytes and pulls the updated P bytes back (one
``push_pull``, sync mode, SGD on the servers); the step time is the slowest worker's. Then the
same workers all-reduce P bytes with the ZMQ backend. The gradient is all ones and the learning
rate a power of two, so after k steps every value must be exactly -k*lr: that is the #wrong check.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

import commrt
from commrt.runtime.config import load_config
from commrt.ps import PSClient
from commrt.bench import metrics
from commrt.bench.report import check_json_path, write_json

LR = 2.0 ** -10


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="commrt bench ps", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-w", "--workers", type=int, default=2)
    p.add_argument("-s", "--servers", type=int, default=2)
    p.add_argument("--params", default="64K,1M,16M", help="parameter bytes per step (comma list)")
    p.add_argument("-n", "--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--json", help="write the rows to this file")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    # each size once: one named twice (64K,65536) was one parameter pushed in two rows, the second
    # row's exact check then off by the first row's steps
    sizes = list(dict.fromkeys(metrics.parse_size(s) for s in args.params.split(",") if s.strip()))
    if not sizes or any(s < 4 or s % 4 for s in sizes):
        raise SystemExit("commrt bench ps: --params sizes must be positive multiples of 4 bytes")
    if args.iters < 1 or args.warmup < 0 or args.workers < 1 or args.servers < 1:
        # -n 0 divided by zero on every worker after the start-up
        raise SystemExit(f"commrt bench ps: need -n >= 1, --warmup >= 0, -w >= 1 and -s >= 1; got -n {args.iters}, "
                         f"--warmup {args.warmup}, -w {args.workers}, -s {args.servers}")
    try:
        check_json_path(args.json)
    except ValueError as exc:
        raise SystemExit(f"commrt bench ps: {exc}") from None
    if "RANK" in os.environ and os.environ.get("COMMRT_PS_SERVERS"):
        return _rank(args, sizes)
    from commrt.launch import launch
    env = {**os.environ, "COMMRT_PS_MODE": "sync", "COMMRT_PS_OPTIMIZER": "sgd", "COMMRT_PS_LR": repr(LR),
           "COMMRT_PS_MOMENTUM": "0", "COMMRT_PS_WEIGHT_DECAY": "0", "COMMRT_COMM_BACKEND": "zmq"}
    cmd = [sys.executable, "-m", "commrt.bench.ps", *(argv if argv is not None else sys.argv[1:])]
    result = launch(args.workers, cmd, servers=args.servers, env=env, prefix=False)
    if result.returncode != 0:
        print(f"commrt bench ps: {result.describe()}", file=sys.stderr)
    return result.returncode


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    commrt.all_reduce(t, commrt.ReduceOp.MAX)
    return float(t[0])


def _time(fn, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    commrt.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return _slowest(time.perf_counter() - start) / iters


def _rank(args, sizes: list[int]) -> int:
    cfg = load_config()
    commrt.init_process_group(backend="zmq")
    rank, world = commrt.get_rank(), commrt.get_world_size()
    client = PSClient(cfg, worker=rank)
    params = {f"p{n}": torch.zeros(n // 4) for n in sizes}
    client.init(params)
    rows = []
    for n in sizes:
        name = f"p{n}"
        one = {name: params[name]}
        grad = {name: torch.ones(n // 4)}
        ps_s = _time(lambda: client.push_pull(grad, one), args.iters, args.warmup)
        expected = torch.full((n // 4,), -(args.iters + args.warmup) * LR)
        wrong = torch.tensor([metrics.count_wrong(params[name], expected)], dtype=torch.int64)
        commrt.all_reduce(wrong)
        buf = torch.ones(n // 4)
        ar_s = _time(lambda: commrt.all_reduce(buf), args.iters, args.warmup)
        rows.append({"size": n, "ps_time_us": ps_s * 1e6, "ps_gbps": metrics.algbw(2 * n, ps_s),
                     "ps_wrong": int(wrong[0]), "allreduce_wrong": _allreduce_wrong(buf, rank, world),
                     "allreduce_time_us": ar_s * 1e6,
                     "allreduce_busbw": metrics.busbw("all_reduce", world, metrics.algbw(n, ar_s)),
                     "ratio": ar_s / ps_s})
    if rank == 0:
        print(table(rows, world, args.servers, args.iters), flush=True)
        if args.json:
            write_json(args.json, {"benchmark": "ps", "workers": world, "servers": args.servers,
                                   "iters": args.iters, "warmup": args.warmup, "rows": rows})
    client.close()
    commrt.destroy_process_group()
    return 1 if any(r["ps_wrong"] or r["allreduce_wrong"] for r in rows) else 0


def _allreduce_wrong(buf: torch.Tensor, rank: int, world: int) -> int:
    """Elements of one more all_reduce that differ from its reference, summed over workers: the
    allreduce column's time was reported unchecked (its timed loop sums in place, so it checks
    a fresh input: rank + 1 everywhere, whose sum is exact)."""
    buf.fill_(rank + 1)
    commrt.all_reduce(buf)
    wrong = torch.tensor([metrics.count_wrong(buf, torch.full_like(buf, world * (world + 1) / 2))])
    commrt.all_reduce(wrong)
    return int(wrong[0])


def table(rows: list[dict], workers: int, servers: int, iters: int) -> str:
    lines = [f"# commrt bench ps: {workers} workers, {servers} servers, sync SGD, float32, iters {iters}",
             "# ps: one push_pull per step (push P bytes, pull P bytes); allreduce: zmq ring, same P",
             f"#{'size':>10} {'ps time':>10} {'push+pull':>10} {'#wrong':>7} {'allreduce':>10} "
             f"{'busbw':>8} {'ratio':>6}",
             f"#{'(B)':>10} {'(us)':>10} {'(GB/s)':>10} {'':>7} {'(us)':>10} {'(GB/s)':>8} {'':>6}"]
    for r in rows:
        lines.append(f" {r['size']:>10} {r['ps_time_us']:>10.1f} {r['ps_gbps']:>10.3f} "
                     f"{r['ps_wrong'] + r.get('allreduce_wrong', 0):>7} "
                     f"{r['allreduce_time_us']:>10.1f} {r['allreduce_busbw']:>8.3f} {r['ratio']:>6.2f}")
    lines.append("# push+pull = 2 x size / ps time per worker; ratio = allreduce time / ps time "
                 "(> 1: the parameter server is faster); #wrong: the ps's and the allreduce's, checked")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
