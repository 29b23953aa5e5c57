"""Compute only, at the pipeline bench's ranks per core: what two processes computing at once
cost against one alone, with no communication at all (issue 29.3's 1F1B >= 1.8x on 2 cores).

    python -m tests.perf.concurrent_compute --dim 512 --blocks 8 --rows 512 --microbatches 16 --rounds 3

Each process trains ``pipeline_lm``'s model (the whole of it) on micro-batches of the bench's size
(``rows / microbatches``), one thread, for ``--mbs`` micro-batches, in rounds alternating: one
process alone, then ``--procs`` processes at once (started together behind a file barrier). It
prints each round's micro-batches per second per process, and the ratio at once / alone: the
most a pipeline of that many stages gets from its cores before any bubble or transfer, since its
stages compute at once for the whole steady state.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def worker(args) -> None:
    import torch

    from commrt.apps.pipeline_model import batch, loss, make_model
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    model = make_model(args.vocab, args.dim, args.blocks)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rows = args.rows // args.microbatches
    x, y = batch(0, rows, args.seq, args.vocab)
    for _ in range(3):  # warm-up, before the barrier
        opt.zero_grad()
        loss(model(x), y).backward()
        opt.step()
    open(os.path.join(args.dir, f"ready-{os.getpid()}"), "w").close()
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(args.dir, "go")):  # bounded: the parent writes it
        if time.monotonic() > deadline:
            raise SystemExit("no go from the parent within 120 s")
        time.sleep(0.001)
    t0 = time.perf_counter()
    for _ in range(args.mbs):
        opt.zero_grad()
        loss(model(x), y).backward()
        opt.step()
    print(json.dumps({"rate": args.mbs / (time.perf_counter() - t0)}))


def run(n: int, argv: list[str]) -> list[float]:
    with tempfile.TemporaryDirectory() as d:
        procs = [subprocess.Popen([sys.executable, "-m", "tests.perf.concurrent_compute", "--worker", "--dir", d,
                                   *argv], stdout=subprocess.PIPE, text=True) for _ in range(n)]
        try:
            deadline = time.monotonic() + 120
            while len([f for f in os.listdir(d) if f.startswith("ready-")]) < n:
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    raise SystemExit("a worker did not get ready")
                time.sleep(0.01)
            open(os.path.join(d, "go"), "w").close()
            return [json.loads(p.communicate(timeout=600)[0])["rate"] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--dir")
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--mbs", type=int, default=64, help="micro-batches per process and round")
    for k, v in (("dim", 512), ("blocks", 8), ("rows", 512), ("microbatches", 16), ("seq", 16), ("vocab", 64)):
        p.add_argument(f"--{k}", type=int, default=v)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    argv = [f"--{k}={getattr(args, k)}" for k in ("dim", "blocks", "rows", "microbatches", "seq", "vocab", "mbs")]
    ratios = []
    print(f"{'round':>5} {'alone (mb/s)':>13} {f'{args.procs} at once, each':>20} {'at once / alone':>16}")
    for r in range(args.rounds):
        alone = run(1, argv)[0]
        together = run(args.procs, argv)
        ratios.append(statistics.fmean(together) / alone)
        print(f"{r:>5} {alone:>13.1f} {' '.join(f'{t:.1f}' for t in together):>20} {ratios[-1]:>16.3f}")
    print(f"median at once / alone: {statistics.median(ratios):.3f}; a {args.procs}-stage pipeline's ceiling "
          f"before its bubble: {args.procs * statistics.median(ratios):.2f}x one process")


if __name__ == "__main__":
    main()
