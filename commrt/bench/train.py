"""``commrt bench train``: the built-in language model (``commrt.apps.train_lm``'s TinyLM) under
a plain torch loop, commrt's DataParallel, replica fault tolerance (``--stages ...,replica``), the
commrt engine at each ZeRO stage and with hpZ / HYBRID_SHARD / MiCS / ZeRO++ over groups of
``--group`` ranks (a node's worth on one host), and torch's DDP and FSDP2 over gloo and over the
``commrt`` torch backend (``train_peers``), over the same ranks, in one run, alternating round by
round:

    commrt bench train -n 2 --stages dp,0,1,2,3 --peers ddp-gloo,fsdp-gloo --dim 384 --layers 4 [--json F]

Every rank runs the plain loop (the same model, batch, loss and ``torch.optim.AdamW``, alone, no
communication) at the same time, so the reference sees the machine as loaded as the engine does;
efficiency = plain step time / strategy step time (1.0: communication and engine cost nothing).
A step's time is the slowest rank's; the median of the steps after ``--warmup`` of every round is
reported, with the engine's step breakdown (``Engine.step_breakdown``, mean over those steps),
the bytes sent per step inside / across nodes (the largest rank's; "n/a" over gloo, which commrt
cannot count), the peak resident memory (the largest rank's high-water mark during the run
of that strategy, reset before each) and the time a step spent in Python's collector (the
slowest rank's, mean over the steps; ``--manual-gc-interval`` moves it to step boundaries).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch import nn

import commrt
from commrt.apps.train_lm import TinyLM, batch, mean_breakdown
from commrt.bench import train_peers
from commrt.bench.report import check_json_path, write_json
from commrt.train import TrainConfig, initialize
from commrt.train.collector import CollectorTime, ManualGC
from commrt.train.ddp import DataParallel
from commrt.train.replica_ft import ReplicaFT
from commrt.launch import free_port


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="commrt bench train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--ranks", type=int, default=2)
    p.add_argument("--stages", default="dp,0,1,2,3",
                   help="commrt strategies (comma list): dp (DataParallel with torch's AdamW), replica "
                   "(fault_tolerance = 'replica': each rank a replica, ReplicaFT with torch's AdamW), "
                   "0-3 (the engine's ZeRO stages), hpz, hybrid, mics, zeropp (stage 3 with groups of --group "
                   "ranks: zero_hpz_partition_size, HYBRID_SHARD's shard_group_size, mics_shard_size, "
                   "docs/configs/zeropp.toml's qwZ + qgZ + hpZ); dp:N, 0:N, 1:N, 2:N: with gradient "
                   "buckets of N MiB (bucket_cap_mb, reduce_bucket_size; default 25)")
    p.add_argument("--group", type=int, default=0,
                   help="ranks per group for hpz/hybrid/mics/zeropp (default: half the ranks, as two nodes)")
    p.add_argument("--peers", default="ddp-gloo,ddp-commrt,fsdp-gloo,fsdp-commrt",
                   help="torch's strategies (comma list, '' for none): ddp or fsdp (FSDP2), over gloo or commrt")
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--steps", type=int, default=8, help="steps per strategy per round")
    p.add_argument("--warmup", type=int, default=2, help="steps dropped at the start of each")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--manual-gc-interval", type=int, default=0, metavar="N",
                   help="Python's collector at step boundaries in every loop of the run, the plain one and "
                   "torch's included (train/collector.py; [train] manual_gc_interval): a full collection every "
                   "N steps; 0 (default): Python's automatic collector, at no step's choosing")
    p.add_argument("--json", help="write the rows to this file")
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    check_args(args)
    if "RANK" in os.environ:
        return _rank(args)
    from commrt.launch import launch  # only the parent starts ranks
    result = launch(args.ranks, [sys.executable, "-m", "commrt.bench.train", *argv], prefix=False)
    if result.returncode != 0:
        print(f"commrt bench train: {result.describe()}", file=sys.stderr)
    return result.returncode


def check_args(args) -> None:
    """Refuse what cannot run before any rank starts (SystemExit naming the option): each of these
    used to fail on every rank after the launch (an unknown --stages name, stage 7, --heads not
    dividing --dim, --rounds 0: the median of no times) or, --warmup -1, to report the bytes
    and memory figures that follow the step times as a step time (merged[-1:n])."""
    if args.manual_gc_interval < 0:
        raise SystemExit("commrt bench train: --manual-gc-interval must be >= 0")
    if args.warmup < 0 or args.steps <= args.warmup:
        raise SystemExit("commrt bench train: need 0 <= --warmup < --steps")
    small = [f"--{k} {getattr(args, k)}" for k in ("ranks", "rounds", "dim", "heads", "vocab", "seq", "batch")
             if getattr(args, k) < 1] + ([f"--layers {args.layers}"] if args.layers < 0 else [])
    if small:
        raise SystemExit(f"commrt bench train: {', '.join(small)}: must be >= 1 (--layers >= 0)")
    if args.dim % args.heads:
        raise SystemExit(f"commrt bench train: --dim {args.dim} is not a multiple of --heads {args.heads}")
    try:
        check_json_path(args.json)
    except ValueError as exc:
        raise SystemExit(f"commrt bench train: {exc}") from None
    # under an outside launcher the world is what counts, not -n (as in _rank)
    strategies(argparse.Namespace(**{**vars(args), "ranks": int(os.environ.get("WORLD_SIZE", args.ranks))}))


def _slowest(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    commrt.all_reduce(t, commrt.ReduceOp.MAX)
    return t.tolist()


GROUPED = {"hpz": "hpZ", "hybrid": "HYBRID_SHARD", "mics": "MiCS", "zeropp": "ZeRO++"}


def grouped_config(name: str, group: int) -> TrainConfig:
    """Stage 3 over groups of ``group`` ranks, as the TOML files in docs/configs write it."""
    zero = {"hpz": {"stage": 3, "zero_hpz_partition_size": group},
            "hybrid": {"sharding_strategy": "HYBRID_SHARD", "shard_group_size": group},
            "mics": {"stage": 3, "mics_shard_size": group},
            "zeropp": {"stage": 3, "zero_hpz_partition_size": group, "zero_quantized_weights": True,
                       "zero_quantized_gradients": True}}[name]
    return TrainConfig.from_dict({"zero_optimization": zero})


def _bucket_mib(stage: str, cap: str) -> float:
    """``dp:4`` / ``0:4`` ... ``2:4``: the gradient buckets' size in MiB (fp32)."""
    try:
        mib = float(cap)
    except ValueError:
        mib = 0.0
    if stage not in ("dp", "0", "1", "2") or not mib > 0:
        raise SystemExit(f"commrt bench train: --stages {stage}:{cap}: a bucket size in MiB (> 0) goes with "
                         "dp, 0, 1 or 2")
    return mib


def strategies(args) -> list[tuple[str, str, object]]:
    """(row name, kind, argument) in the order every round runs them."""
    out = [("plain torch", "plain", None)]
    for s in (s.strip() for s in args.stages.split(",") if s.strip()):
        s, _, cap = s.partition(":")
        if cap:  # a gradient bucket size: DataParallel's bucket_cap_mb, the engine's reduce_bucket_size
            mib = _bucket_mib(s, cap)
            if s == "dp":
                out.append((f"commrt DataParallel {cap}MiB", "dp", mib))
            else:
                cfg = TrainConfig.from_dict({"zero_optimization": {"stage": int(s),
                                                                   "reduce_bucket_size": int(mib * (1 << 18))}})
                out.append((f"commrt stage {int(s)} {cap}MiB", "engine", cfg))
            continue
        named = {"dp": ("commrt DataParallel", "dp", None), "replica": ("commrt replica FT", "replica", None)}
        if s in GROUPED:
            group = args.group or max(args.ranks // 2, 1)
            if args.ranks % group:
                raise SystemExit(f"commrt bench train: --group {group} does not divide {args.ranks} ranks")
            out.append((f"commrt {GROUPED[s]} /{group}", "engine", grouped_config(s, group)))
        elif s in named or s in ("0", "1", "2", "3"):
            out.append(named[s] if s in named else (f"commrt stage {int(s)}", "engine", int(s)))
        else:
            raise SystemExit(f"commrt bench train: --stages takes dp, replica, 0, 1, 2, 3, {', '.join(GROUPED)}, "
                             f"not {s!r}")
    for p in (p.strip() for p in args.peers.split(",") if p.strip()):
        wrapper, _, backend = p.partition("-")
        if wrapper not in train_peers.WRAPPERS or backend not in ("gloo", "commrt"):
            raise SystemExit(f"commrt bench train: --peers takes ddp-gloo, ddp-commrt, fsdp-gloo, fsdp-commrt, not {p!r}")
        out.append((f"torch {'DDP' if wrapper == 'ddp' else 'FSDP2'} {backend}", wrapper, backend))
    return out


def _setup(args, kind: str, arg, groups):
    """A model under one strategy: (step(tokens), breakdown() or None, where its bytes are counted,
    close() or None: what to shut after the run; it returns extra figures for the row)."""
    torch.manual_seed(0)
    model = TinyLM(args.vocab, args.dim, args.layers, args.heads, args.seq)
    loss_fn, vocab = nn.CrossEntropyLoss(), args.vocab

    def loss_of(net, tokens):
        return loss_fn(net(tokens[:, :-1]).reshape(-1, vocab), tokens[:, 1:].reshape(-1))

    if kind == "engine":
        engine = initialize(model, arg if isinstance(arg, TrainConfig) else TrainConfig().with_stage(arg))

        def engine_step(tokens):
            engine.backward(loss_of(engine, tokens))
            engine.step()
        engine_step.settle = engine.settle  # overlap_step: the last step's bytes still crossing
        return engine_step, engine.step_breakdown, "engine", None
    if kind == "replica":
        return _replica(model, loss_of)
    net, where = model, None
    if kind == "dp":
        net, where = DataParallel(model, **({"bucket_cap_mb": arg} if arg else {})), "engine"
    elif kind != "plain":
        net, where = train_peers.WRAPPERS[kind](model, groups.groups[arg]), arg
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)

    def step(tokens):
        opt.zero_grad(set_to_none=True)
        loss_of(net, tokens).backward()
        opt.step()
    return step, (net.step_breakdown if kind == "dp" else None), where, None


def _replica(model, loss_of):
    """fault_tolerance = "replica" over the same ranks, each a replica: its store served by rank
    0 on a fresh port (a real job serves it from the launcher), its generation's world the
    default while it runs (bytes counted there). The row's extra figures: ReplicaFT's time per
    step in each phase (copy, all_reduce, vote, apply; ms)."""
    rank, port = commrt.get_rank(), torch.tensor([free_port() if commrt.get_rank() == 0 else 0])
    commrt.broadcast(port, 0)
    ft = ReplicaFT(model, torch.optim.AdamW(model.parameters(), lr=1e-3), rank, commrt.get_world_size(),
                   f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{int(port)}", serve_store=rank == 0)
    ft.start()
    steps = []

    def step(tokens):
        loss_of(model, tokens).backward()
        steps.append(ft.step())

    def close():
        spent = dict(ft.counts.time_s)
        ft.close()
        return {k: round(1000 * v / max(len(steps), 1), 3) for k, v in spent.items()}
    return step, None, "engine", close


def _run(args, kind: str, arg, groups, collector: ManualGC) -> dict:
    """One strategy's steps: times (slowest rank), breakdowns, bytes per step, peak memory, and
    the time each step spent in Python's collector (the slowest rank's, counted in the step)."""
    step, breakdown, where, close = _setup(args, kind, arg, groups)
    rank = commrt.get_rank()
    train_peers.reset_peak_memory()
    commrt.barrier()
    sent0 = train_peers.bytes_sent(where) if where else (0, 0)
    local, parts, in_gc, full = [], [], [], 0
    for i in range(args.steps):
        tokens = batch(rank, i, args.batch, args.seq, args.vocab)
        gc0, full0 = CollectorTime.read()
        start = time.perf_counter()
        step(tokens)
        collector.step()  # the step's end, as a training loop calls it
        local.append(time.perf_counter() - start)
        gc1, full1 = CollectorTime.read()
        in_gc.append(gc1 - gc0)
        full += (full1 - full0) if i >= args.warmup else 0
        if breakdown is not None:
            parts.append(breakdown())
    if hasattr(step, "settle"):  # counted in the run's bytes (its time is a warm-up step's to the next)
        step.settle()
    sent1 = train_peers.bytes_sent(where) if where else (0, 0)
    per_step = None if sent0 is None or sent1 is None else [(b - a) / args.steps for a, b in zip(sent0, sent1)]
    # after the loop: no extra collective inside a step; one all-reduce for times, bytes, memory
    n = args.steps
    merged = _slowest(local + in_gc + [train_peers.peak_memory_mb(), float(full)] + (per_step or [0.0, 0.0]))
    return {"times": merged[args.warmup:n], "breakdowns": [b for b in parts[args.warmup:] if b is not None],
            "gc": merged[n + args.warmup:2 * n], "peak_mb": merged[2 * n], "full_gcs": int(merged[2 * n + 1]),
            "bytes": None if per_step is None else merged[2 * n + 2:], "extra": close() if close is not None else None}


def _rank(args) -> int:
    torch.set_num_threads(1)
    CollectorTime.install()
    collector = ManualGC(args.manual_gc_interval)
    commrt.init_process_group()
    args.ranks = commrt.get_world_size()  # under an outside launcher -n is not what counts
    plan = strategies(args)
    groups = train_peers.TorchGroups() if any(k in train_peers.WRAPPERS for _, k, _ in plan) else None
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in plan}
    for _ in range(args.rounds):  # alternate: load changes hit every strategy alike
        for name, kind, arg in plan:
            runs[name].append(_run(args, kind, arg, groups, collector))
    rows = _rows(args, plan, runs)
    if commrt.get_rank() == 0:
        print(table(rows))
        if args.json:
            write_json(args.json, {"command": "commrt bench train " + " ".join(sys.argv[1:]), "rows": rows})
    if groups is not None:
        groups.close()
    commrt.destroy_process_group()
    collector.close()
    return 0


def _rows(args, plan, runs) -> list[dict]:
    rows, world = [], commrt.get_world_size()
    base = statistics.median(t for r in runs[plan[0][0]] for t in r["times"])
    for name, _, _ in plan:
        rs = runs[name]
        step = statistics.median(t for r in rs for t in r["times"])
        parts = [b for r in rs for b in r["breakdowns"]]
        sent = rs[-1]["bytes"]
        rows.append({"strategy": name, "ranks": world, "step_ms": round(step * 1000, 2),
                     "samples_per_s": round(world * args.batch / step, 1), "efficiency": round(base / step, 3),
                     "intra_node_mb_per_step": None if sent is None else round(sent[0] / 2**20, 3),
                     "inter_node_mb_per_step": None if sent is None else round(sent[1] / 2**20, 3),
                     "peak_rss_mb": round(max(r["peak_mb"] for r in rs), 1),
                     "breakdown_ms": mean_breakdown(parts).as_ms() if parts else None,
                     "gc_ms": round(1000 * statistics.mean(g for r in rs for g in r["gc"]), 2),
                     "full_gcs": sum(r["full_gcs"] for r in rs),
                     "phases_ms": _mean_phases([r["extra"] for r in rs if r["extra"]]),
                     "round_ms": [[round(t * 1000, 1) for t in r["times"]] for r in rs]})
    return rows


def _mean_phases(extras: list[dict]) -> dict | None:
    """Rank 0's mean over the rounds (whole runs, warm-up included)."""
    return {k: round(sum(e[k] for e in extras) / len(extras), 3) for k in extras[0]} if extras else None


def table(rows: list[dict]) -> str:
    def mb(v):
        return "n/a" if v is None else f"{v:.2f}"

    def gc_ms(v):
        return "n/a" if v is None else f"{v:.1f}"
    w = max([22, *(len(r["strategy"]) for r in rows)])  # "commrt HYBRID_SHARD /16" is 23
    lines = [f"{'strategy':{w}s} {'ranks':>5s} {'step ms':>9s} {'samples/s':>10s} {'efficiency':>10s} "
             f"{'MiB/step in':>11s} {'across':>7s} {'peak RSS':>9s} {'gc ms':>6s}  breakdown (ms)"]
    for r in rows:
        b = r["breakdown_ms"]
        text = "" if b is None else (f"fwd {b['forward']:.1f} bwd {b['backward']:.1f} opt {b['optimizer']:.1f} "
                                     f"waited {b['comm_waited']:.1f} hidden {b['comm_hidden']:.1f} "
                                     f"bookkeeping {b['bookkeeping']:.1f}")
        if r.get("phases_ms"):
            text = " ".join(f"{k} {v:.2f}" for k, v in r["phases_ms"].items())
        lines.append(f"{r['strategy']:{w}s} {r['ranks']:5d} {r['step_ms']:9.1f} {r['samples_per_s']:10.1f} "
                     f"{r['efficiency']:10.3f} {mb(r['intra_node_mb_per_step']):>11s} "
                     f"{mb(r['inter_node_mb_per_step']):>7s} {r['peak_rss_mb']:8.0f}M {gc_ms(r.get('gc_ms')):>6s}  {text}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
