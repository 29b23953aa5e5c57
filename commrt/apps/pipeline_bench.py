"""``python -m workers.pipeline_lm --stages 2 --microbatches 8 --bench``: in one run, alternating
round by round, the samples/s of single-process training (rank 0 alone, the whole model, the
whole batch; the other ranks wait) and of every pipeline schedule over the same model and
batches, one thread per process, with each schedule's measured bubble next to the theory.

The ratios are taken within a round (the same machine load for each) and their median over
rounds reported; round 0 warms up and is dropped. PipeDream trains ``--steps`` batches per
``step()`` with no flush between them (its steady state); the synchronous schedules flush after
every batch.
"""
from __future__ import annotations

import statistics
import time
from collections import defaultdict

import torch

import commrt
from commrt.runtime.errors import ConfigError
from commrt.apps.pipeline_model import batch, build, loss, make_model
from commrt.pipeline.timeline import theory_bubble

KINDS = ("gpipe", "1f1b", "interleaved", "pipedream")


def _single(model, opt, data) -> None:
    """The reference: the unsplit model on the whole batch, in this process alone."""
    for x, y in data:
        opt.zero_grad()
        loss(model(x), y).backward()
        opt.step()


def _pipelined(kind: str, run, data, first: bool, last: bool) -> list[tuple[float, float, float]]:
    """Train ``data`` with one schedule; (bubble, seconds computing, seconds of the runtime's own
    work: Timeline.own) of each step on this rank."""
    _, sched, opt = run
    if kind == "pipedream":
        x, y = torch.cat([d[0] for d in data]), torch.cat([d[1] for d in data])
        sched.step(*((x,) if first else ()), target=y if last else None)
        return [_measures(sched.timeline)]
    bubbles = []
    for x, y in data:
        opt.zero_grad()
        sched.step(*((x,) if first else ()), target=y if last else None)
        opt.step()
        bubbles.append(_measures(sched.timeline))
    return bubbles


def _measures(tl) -> tuple[float, float, float]:
    return tl.bubble(), tl.busy(), tl.own()


def run(args, log) -> None:
    torch.set_num_threads(1)  # one thread per process, in both the reference and the pipeline
    torch.set_flush_denormal(True)  # tiny gradients must not slow one side down
    rank, world = commrt.get_rank(), commrt.get_world_size()
    if world < 2 or args.dp != 1:
        raise ConfigError(f"--bench needs 2 or more pipeline ranks and no --dp; got {world} ranks, dp {args.dp}")
    runs = {}
    for kind in KINDS:
        stages, sched, n = build(args, kind, num_batches=args.steps)
        opt = torch.optim.SGD([p for s in stages for p in s.module.parameters()], lr=args.lr)
        runs[kind] = (n, sched, opt)
    model = make_model(args.vocab, args.dim, args.blocks) if rank == 0 else None
    single = (model, torch.optim.SGD(model.parameters(), lr=args.lr)) if model is not None else None
    data = [batch(s, args.rows, args.seq, args.vocab) for s in range(args.steps)]
    seconds, bubbles, cpu = defaultdict(list), defaultdict(list), defaultdict(lambda: [0.0, 0.0])
    for rnd in range(args.rounds + 1):
        for kind in ("single", *KINDS):
            commrt.barrier()
            t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
            if kind == "single":
                if rank == 0:
                    _single(*single, data)
            else:
                n, sched, _ = runs[kind]
                b = _pipelined(kind, runs[kind], data, 0 in sched.stages, n - 1 in sched.stages)
                if rnd:
                    bubbles[kind] += b
            commrt.barrier()
            if rnd:
                seconds[kind].append(time.perf_counter() - t0)
                cpu[kind][0] += time.thread_time() - c0  # this (main) thread's CPU seconds
                cpu[kind][1] += time.process_time() - p0  # and every thread's (the transport's too)
    _report(args, log, runs, seconds, bubbles, cpu, rank, world)


def _report(args, log, runs, seconds, bubbles, cpu, rank: int, world: int) -> None:
    # every rank's mean bubble, its seconds computing, its main thread's and all its threads' CPU,
    # and the runtime's own seconds per micro-batch and stage
    per_rank = torch.zeros(5, len(KINDS), world, dtype=torch.float64)
    for i, kind in enumerate(KINDS):
        n = runs[kind][0] // world * args.microbatches * (args.steps if kind == "pipedream" else 1)
        per_rank[0, i, rank] = statistics.fmean(b for b, _, _ in bubbles[kind])
        per_rank[1, i, rank] = sum(t for _, t, _ in bubbles[kind]) / args.rounds
        per_rank[2:4, i, rank] = torch.tensor(cpu[kind], dtype=torch.float64)
        per_rank[4, i, rank] = statistics.fmean(o for _, _, o in bubbles[kind]) / n
    commrt.all_reduce(per_rank)
    if rank != 0:
        return
    samples = args.steps * args.rows
    single = statistics.median(samples / s for s in seconds["single"])
    log.info("model: %d blocks of %d, %d rows x %d tokens per batch, %d micro-batches, %d ranks, "
             "%d rounds of %d batches", args.blocks, args.dim, args.rows, args.seq, args.microbatches,
             world, args.rounds, args.steps)
    every = getattr(args, "manual_gc_interval", 0)
    log.info("python's collector: %s", f"off, a full collection every {every} steps of each schedule (in "
             "the single process's rounds too: off)" if every else "automatic (--manual-gc-interval N: at steps)")
    log.info("%-12s %10s %8s  %-16s %6s  %-8s %-8s %-14s %s", "schedule", "samples/s", "vs 1 proc", "bubble per rank",
             "theory", "compute", "cpu", "other threads", "own us/mb per rank")
    log.info("%-12s %10.1f %8s", "single", single, "1.00x")  # compute, cpu: the ratio of the single
    # process's seconds to the pipeline's summed over its ranks
    for i, kind in enumerate(KINDS):
        n, sched, _ = runs[kind]
        ratio = statistics.median(a / b for a, b in zip(seconds["single"], seconds[kind]))
        m = args.microbatches * (args.steps if kind == "pipedream" else 1)
        theory = theory_bubble(world, m, n // world)
        # the single process's time over the ranks' summed compute time: what smaller matrices
        # and the per-micro-batch work cost, apart from the bubble
        # (wall seconds computing); the same in CPU seconds of the main threads, which machine load
        # does not inflate; and the CPU the other threads (the transport's) took beside them
        compute = statistics.fmean(seconds["single"]) / float(per_rank[1, i].sum())
        main_cpu = float(per_rank[2, i].sum())
        others = (float(per_rank[3, i].sum()) - main_cpu) / main_cpu
        bubble = " ".join(f"{b:.3f}" for b in per_rank[0, i].tolist())
        log.info("%-12s %10.1f %7.2fx  %-16s %6.3f  %-8.2f %-8.2f %-14s %s", kind,
                 samples / statistics.median(seconds[kind]), ratio, bubble,
                 theory, compute, cpu["single"][0] / main_cpu, f"{100 * others:.1f}%",
                 " ".join(f"{1e6 * o:.0f}" for o in per_rank[4, i].tolist()))
    pd = runs["pipedream"][1]
    ratio = statistics.median(b / a for a, b in zip(seconds["pipedream"], seconds["1f1b"]))
    log.info("pipedream vs 1f1b: %.2fx; its cost: every batch's gradient is computed on weights %d "
             "update(s) old (PipeDream-2BW's rule), %d weight versions held", ratio, pd.staleness,
             pd.versions_kept)
