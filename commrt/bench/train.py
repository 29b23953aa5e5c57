"""``commrt bench train``: the built-in language model (``commrt.apps.train_lm``'s TinyLM) under
a plain torch loop and under the commrt engine at each ZeRO stage, over the same ranks, in one
run, alternating round by round:

    commrt bench train -n 2 --stages 0,1,2,3 --dim 384 --layers 4 --steps 8 [--json F]

Every rank runs the plain loop (the same model, batch, loss and ``torch.optim.AdamW``, alone, no
communication) at the same time, so the reference sees the machine as loaded as the engine does;
efficiency = plain step time / strategy step time (1.0: communication and engine cost nothing).
A step's time is the slowest rank's; the median of the steps after ``--warmup`` of every round is
reported, with the engine's step breakdown (``Engine.step_breakdown``, mean over those steps).
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
from commrt.bench.report import write_json
from commrt.train import TrainConfig, initialize


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="commrt bench train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--ranks", type=int, default=2)
    p.add_argument("--stages", default="0,1,2,3", help="ZeRO stages to run (comma list)")
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--steps", type=int, default=8, help="steps per strategy per round")
    p.add_argument("--warmup", type=int, default=2, help="steps dropped at the start of each")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", help="write the rows to this file")
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.steps <= args.warmup:
        raise SystemExit("commrt bench train: --steps must exceed --warmup")
    if "RANK" in os.environ:
        return _rank(args)
    from commrt.launch import launch  # only the parent starts ranks
    result = launch(args.ranks, [sys.executable, "-m", "commrt.bench.train", *argv], prefix=False)
    if result.returncode != 0:
        print(f"commrt bench train: {result.describe()}", file=sys.stderr)
    return result.returncode


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    commrt.all_reduce(t, commrt.ReduceOp.MAX)
    return float(t)


def _run(args, stage: int | None) -> tuple[list[float], list]:
    """Step times (slowest rank) and breakdowns of one strategy: None is the plain torch loop."""
    torch.manual_seed(0)
    model = TinyLM(args.vocab, args.dim, args.layers, args.heads, args.seq)
    loss_fn, rank = nn.CrossEntropyLoss(), commrt.get_rank()
    if stage is None:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        engine = initialize(model, TrainConfig().with_stage(stage))
    times, local, breakdowns = [], [], []
    for step in range(args.steps):
        tokens = batch(rank, step, args.batch, args.seq, args.vocab)
        start = time.perf_counter()
        if stage is None:
            opt.zero_grad(set_to_none=True)
            loss_fn(model(tokens[:, :-1]).reshape(-1, args.vocab), tokens[:, 1:].reshape(-1)).backward()
            opt.step()
        else:
            engine.backward(loss_fn(engine(tokens[:, :-1]).reshape(-1, args.vocab), tokens[:, 1:].reshape(-1)))
            engine.step()
            breakdowns.append(engine.step_breakdown())
        local.append(time.perf_counter() - start)
    times = [_slowest(t) for t in local]  # after the loop: no extra collective inside a step
    return times[args.warmup:], breakdowns[args.warmup:]


def _rank(args) -> int:
    torch.set_num_threads(1)
    commrt.init_process_group()
    stages = [int(s) for s in args.stages.split(",") if s.strip()]
    names = ["plain torch"] + [f"commrt stage {s}" for s in stages]
    times: dict[str, list[float]] = {n: [] for n in names}
    parts: dict[str, list] = {n: [] for n in names}
    for _ in range(args.rounds):
        for name, stage in zip(names, [None, *stages]):
            t, b = _run(args, stage)
            times[name] += t
            parts[name] += b
    rows, world = [], commrt.get_world_size()
    base = statistics.median(times[names[0]])
    for name in names:
        step = statistics.median(times[name])
        rows.append({"strategy": name, "ranks": world, "step_ms": round(step * 1000, 2),
                     "samples_per_s": round(world * args.batch / step, 1), "efficiency": round(base / step, 3),
                     "breakdown_ms": mean_breakdown(parts[name]).as_ms() if parts[name] else None})
    if commrt.get_rank() == 0:
        print(table(rows))
        if args.json:
            write_json(args.json, {"command": "commrt bench train " + " ".join(sys.argv[1:]), "rows": rows})
    commrt.destroy_process_group()
    return 0


def table(rows: list[dict]) -> str:
    lines = [f"{'strategy':16s} {'ranks':>5s} {'step ms':>9s} {'samples/s':>10s} {'efficiency':>10s}  breakdown (ms)"]
    for r in rows:
        b = r["breakdown_ms"]
        text = "" if b is None else (f"fwd {b['forward']:.1f} bwd {b['backward']:.1f} opt {b['optimizer']:.1f} "
                                     f"waited {b['comm_waited']:.1f} hidden {b['comm_hidden']:.1f} "
                                     f"bookkeeping {b['bookkeeping']:.1f}")
        lines.append(f"{r['strategy']:16s} {r['ranks']:5d} {r['step_ms']:9.1f} {r['samples_per_s']:10.1f} "
                     f"{r['efficiency']:10.3f}  {text}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
