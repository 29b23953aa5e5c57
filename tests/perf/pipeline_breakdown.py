"""Where a pipeline step's time goes, per micro-batch and stage: compute, waiting in receives,
and the runtime's own work (Timeline.own), averaged over many steps of one schedule on the
``pipeline_lm`` model (the same ``build()`` and SGD step as ``--bench``). Starts its 2 ranks:

    python -m tests.perf.pipeline_breakdown --schedule 1f1b --steps 200
    python -m tests.perf.pipeline_breakdown --schedule interleaved --dim 512 --blocks 8 --rows 512 \\
        --microbatches 16 --warmup 2 --steps 3

Add ``--profile`` for a cProfile of each rank's main thread (top 35 by own time, to stdout), and
``--channels`` for the main thread's time per step in the channels' send / pump / take (the
sender's posting, the receiver's landing of what has arrived, and the wait for what has not).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import resource
import sys
import time
from collections import defaultdict

import torch

import commrt
from commrt.apps.pipeline_model import batch, build
from commrt.pipeline import channels

CHANNEL_TIME: dict[str, list] = defaultdict(lambda: [0.0, 0])  # method -> [seconds, calls]


def _timed(name: str, fn):
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            CHANNEL_TIME[name][0] += time.perf_counter() - t0
            CHANNEL_TIME[name][1] += 1
    return wrapper


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved"])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--split", default="params", choices=["params", "layers", "time"])
    p.add_argument("--profile", action="store_true")
    p.add_argument("--channels", action="store_true", help="time the channels' send / pump / take")
    return p.parse_args(argv)


def run(args) -> None:
    torch.set_num_threads(1)
    if args.channels:
        for name in ("send", "pump", "take"):
            setattr(channels.Channels, name, _timed(name, getattr(channels.Channels, name)))
    commrt.init_process_group()
    rank, world = commrt.get_rank(), commrt.get_world_size()
    stages, sched, n = build(args, args.schedule)
    opt = torch.optim.SGD([p for s in stages for p in s.module.parameters()], lr=args.lr)
    first, last = 0 in sched.stages, n - 1 in sched.stages
    data = [batch(s, args.rows, args.seq, args.vocab) for s in range(10)]
    tot = [0.0, 0.0, 0.0]  # compute, waited, own: seconds over the measured steps

    def steps(k: int) -> None:
        for i in range(k):
            x, y = data[i % len(data)]
            opt.zero_grad()
            sched.step(*((x,) if first else ()), target=y if last else None)
            opt.step()
            tl = sched.timeline
            tot[0], tot[1], tot[2] = tot[0] + tl.busy(), tot[1] + tl.waited(), tot[2] + tl.own()

    steps(args.warmup)
    tot[:] = [0.0, 0.0, 0.0]
    CHANNEL_TIME.clear()
    commrt.barrier()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    prof = cProfile.Profile() if args.profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    steps(args.steps)
    if prof:
        prof.disable()
    commrt.barrier()
    wall = (time.perf_counter() - t0) / args.steps
    per = args.steps * args.microbatches * (n // world)
    print(f"rank {rank} {args.schedule}: step {wall * 1e3:.3f} ms; per micro-batch and stage (us): compute "
          f"{tot[0] / per * 1e6:.0f}, waited in receives {tot[1] / per * 1e6:.0f}, own {tot[2] / per * 1e6:.0f}",
          flush=True)
    if args.channels:
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        print(f"rank {rank}: {faults / args.steps:.0f} minor page faults a step", flush=True)
    for name, (sec, calls) in sorted(CHANNEL_TIME.items()):
        print(f"rank {rank}: channels.{name}: {sec / args.steps * 1e3:.1f} ms a step, {calls // args.steps} calls, "
              f"{sec / max(calls, 1) * 1e6:.0f} us each", flush=True)
    if prof:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(35)
        print(f"rank {rank} profile:\n{out.getvalue()}", flush=True)
    commrt.destroy_process_group()


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    if "RANK" not in os.environ:  # the parent starts the ranks
        from commrt.launch import launch
        return launch(2, [sys.executable, "-m", "tests.perf.pipeline_breakdown", *argv], prefix=False).returncode
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
