"""Train a small next-token model as a pipeline, one stage per rank:

    commrt launch -n 2 -- python -m workers.pipeline_lm --schedule 1f1b --microbatches 8 --steps 30
    python -m workers.pipeline_lm --stages 2 --schedule 1f1b --microbatches 8 --timeline
    python -m workers.pipeline_lm --stages 2 --dp 2 --dp-wrap zero1       # 2 stages x 2 replicas
    python -m workers.pipeline_lm --stages 2 --microbatches 8 --bench     # throughput and bubbles

With ``--stages`` and no launcher around it, the program starts its ``stages x dp`` ranks itself.
The model is an ``nn.Sequential`` (embedding, MLP blocks, output layer) cut with
``commrt.pipeline.split``; the data is the counting corpus of ``commrt.apps.train_lm`` (the next
token is the current one plus one, modulo the vocabulary), so the loss falls well below
log(vocab). ``--schedule pipedream`` runs PipeDream (no flush, weight stashing, SGD).
``--dp N`` replicates every stage N times (pipeline x data parallel over a device mesh), each
replica reducing gradients with DataParallel or ZeRO stage 1 (``--dp-wrap``). ``--timeline``
prints every rank's last step as a text timeline with its bubble next to the theory; ``--bench``
measures single-process against pipelined throughput (commrt.apps.pipeline_bench).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

import commrt
import commrt.train
from commrt.apps import pipeline_bench, reporter
from commrt.apps.pipeline_model import SCHEDULES, batch, build
from commrt.pipeline.timeline import gantt, theory_bubble
from commrt.train.config import load_train_config

def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schedule", choices=[*SCHEDULES, "pipedream"], default="1f1b")
    p.add_argument("--stages", type=int, default=None,
                   help="pipeline ranks; without a launcher, start stages x dp ranks here")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas of every stage")
    p.add_argument("--dp-wrap", choices=["ddp", "zero1"], default="ddp")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--split", choices=["params", "layers", "time"], default="params",
                   help="cut the model into stages evening parameters, layers, or measured time")
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--timeline", action="store_true", help="print each rank's last step and its bubble")
    p.add_argument("--bench", action="store_true", help="single-process vs pipelined samples/s")
    p.add_argument("--rounds", type=int, default=3, help="--bench: alternating rounds")
    p.add_argument("--manual-gc-interval", type=int, default=None, metavar="N",
                   help="Python's collector off, a full collection every N steps on every rank "
                        "([train] manual_gc_interval of COMMRT_CONFIG; default there 0: automatic)")
    return p.parse_args(argv)


def check_args(args, environ=os.environ) -> str | None:
    """What is wrong with the options, said before any rank starts (None: nothing); each used to
    fail after the launch on every rank, or (rows not a multiple of --dp) to train replicas on
    unequal slices weighted alike by the gradient average, which is not the one-process batch."""
    positive = ("dp", "microbatches", "steps", "rows", "seq", "vocab", "dim")
    bad = [f"--{k} {getattr(args, k)}" for k in positive if getattr(args, k) < 1]
    if args.stages is not None and args.stages < 1:
        bad.append(f"--stages {args.stages}")
    if bad or args.blocks < 0:
        return f"{', '.join(bad + ([f'--blocks {args.blocks}'] if args.blocks < 0 else []))}: must be >= 1 " \
               "(--blocks >= 0)"
    if args.manual_gc_interval is not None and args.manual_gc_interval < 0:
        return f"--manual-gc-interval {args.manual_gc_interval}: must be >= 0 (0: Python's automatic collector)"
    if args.rows % args.dp:
        return f"--rows {args.rows} is not a multiple of --dp {args.dp} (each replica takes rows / dp of a batch)"
    if args.rows // args.dp < args.microbatches:
        return (f"{args.rows // args.dp} rows per replica (--rows {args.rows} / --dp {args.dp}) cannot make "
                f"--microbatches {args.microbatches} micro-batches")
    if "RANK" in environ and "WORLD_SIZE" in environ:  # under a launcher --stages is not what counts
        world = int(environ["WORLD_SIZE"])
    else:
        world = args.stages * args.dp if args.stages is not None else args.dp
    if world % args.dp:
        return f"--dp {args.dp} does not divide the world of {world} ranks"
    if args.schedule == "pipedream" and args.dp > 1:  # PipeDream refuses a replicated stage
        return f"--schedule pipedream takes no --dp (got --dp {args.dp}): its weight versions bypass the " \
               "replicas' gradient reduction"
    if args.schedule == "interleaved" and world // args.dp < 2:  # two stages on one rank: sends to itself
        return "--schedule interleaved needs 2 or more pipeline ranks (it puts two stages on each)"
    if args.bench and (args.rounds < 1 or args.dp != 1 or world < 2):  # after the launch: medians of nothing
        return (f"--bench needs --rounds >= 1, 2 or more pipeline ranks and no --dp; got --rounds {args.rounds}, "
                f"{world} ranks, --dp {args.dp}")
    # --bench builds every schedule, the interleaved one too (two stages a rank)
    stages = world // args.dp * (2 if args.schedule == "interleaved" or args.bench else 1)
    layers = 2 * args.blocks + 3  # make_model: embedding, (linear, gelu) per block, linear, flatten
    if stages > layers:
        return f"{stages} pipeline stages cannot be cut from the model's {layers} layers (--blocks {args.blocks})"
    return None


def self_launch(args, argv) -> int | None:
    """Start the ranks here when asked for ``--stages`` outside a launcher."""
    if args.stages is None or "RANK" in os.environ:
        return None
    from commrt.launch import launch  # only the parent needs the launcher
    result = launch(args.stages * args.dp, [sys.executable, "-m", "commrt.apps.pipeline_lm", *argv], prefix=False)
    return result.returncode


def report_timeline(log, sched, args, ranks: int, per_rank: int, batches: int = 1) -> None:
    tl = sched.timeline
    m = args.microbatches * batches
    log.info("timeline %s |%s| %.1f ms, bubble %.3f (theory %.3f), waited in receives %.1f ms",
             args.schedule, gantt(tl.events, tl.wall), tl.wall * 1e3, tl.bubble(),
             theory_bubble(ranks, m, per_rank), tl.waited() * 1e3)


def train_pipedream(args, log, sched, data, first: bool, last: bool) -> None:
    """All ``--steps`` batches in one ``step()``: PipeDream never flushes between them."""
    xs, ys = zip(*(data(s) for s in range(args.steps)))
    losses: list = []
    sched.step(*((torch.cat(xs),) if first else ()), target=torch.cat(ys) if last else None, losses=losses)
    if last:
        for s in range(0, args.steps, max(1, args.steps // 10)):
            chunk = losses[s * args.microbatches:(s + 1) * args.microbatches]
            log.info("step %d loss %.4f", s, float(sum(chunk) / len(chunk)))


def train(args, log) -> None:
    pp_group = dp_group = None
    replica = 0
    if args.dp > 1:
        mesh = commrt.init_device_mesh((args.dp, commrt.get_world_size() // args.dp), ("dp", "pp"))
        pp_group, dp_group, replica = mesh.get_group("pp"), mesh.get_group("dp"), mesh.get_local_rank("dp")
    nb = args.steps if args.schedule == "pipedream" else 1
    stages, sched, n = build(args, args.schedule, pp_group, dp_group, nb)
    first, last = 0 in sched.stages, n - 1 in sched.stages
    ranks = commrt.get_world_size() // args.dp

    def data(step):
        x, y = batch(step, args.rows, args.seq, args.vocab)
        return x.chunk(args.dp)[replica], y.chunk(args.dp)[replica]
    if args.schedule == "pipedream":
        train_pipedream(args, log, sched, data, first, last)
        if args.timeline:
            report_timeline(log, sched, args, ranks, 1, nb)
        return
    engines = [st.module for st in stages if isinstance(st.module, commrt.train.Engine)]
    opt = None if engines else torch.optim.SGD([p for s in stages for p in s.module.parameters()],
                                               lr=args.lr, momentum=0.9)
    for step in range(args.steps):
        x, y = data(step)
        losses = []
        if opt is not None:
            opt.zero_grad()
        sched.step(*((x,) if first else ()), target=y if last else None, losses=losses)
        for e in engines:
            e.step()
        if opt is not None:
            opt.step()
        if last and (step % max(1, args.steps // 10) == 0 or step == args.steps - 1):
            log.info("step %d loss %.4f", step, float(sum(losses) / len(losses)))
    if args.timeline:
        report_timeline(log, sched, args, ranks, n // ranks)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    problem = check_args(args)
    if problem:
        print(f"pipeline_lm: error: {problem}", file=sys.stderr)
        raise SystemExit(2)  # argparse's status for a bad option
    code = self_launch(args, argv)
    if code is not None:
        return code
    if args.manual_gc_interval is None:  # the config's, where the flag does not say
        args.manual_gc_interval = load_train_config(os.environ.get("COMMRT_CONFIG")).manual_gc_interval
    commrt.init_process_group()
    log = reporter("pipeline_lm", f"rank {commrt.get_rank()}")
    if args.bench:
        pipeline_bench.run(args, log)
    else:
        train(args, log)
    commrt.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
