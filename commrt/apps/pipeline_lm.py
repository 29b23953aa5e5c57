"""Train a small next-token model as a pipeline, one stage per rank:

    commrt launch -n 2 -- python -m workers.pipeline_lm --schedule 1f1b --microbatches 8 --steps 30

The model is an ``nn.Sequential`` (embedding, MLP blocks, output layer) cut with
``commrt.pipeline.split``; the data is the counting corpus of ``commrt.apps.train_lm`` (the next
token is the current one plus one, modulo the vocabulary), so the loss falls well below
log(vocab). ``--schedule pipedream`` runs PipeDream (no flush, weight stashing, SGD).
"""
from __future__ import annotations

import argparse
import logging
import sys

import torch
from torch import nn

import commrt
from commrt.pipeline import GPipe, Interleaved1F1B, OneFOneB, PipeDream, PipelineStage, split

log = logging.getLogger("pipeline_lm")
SCHEDULES = {"gpipe": GPipe, "1f1b": OneFOneB, "interleaved": Interleaved1F1B}


class Flat(nn.Module):
    """[batch, seq, vocab] -> [batch * seq, vocab] so the loss is a plain cross-entropy."""

    def forward(self, x):
        return x.reshape(-1, x.shape[-1])


def make_model(vocab: int, dim: int, blocks: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Embedding(vocab, dim)]
    for _ in range(blocks):
        layers += [nn.Linear(dim, dim), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(dim, vocab), Flat())


def batch(step: int, rows: int, seq: int, vocab: int):
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, vocab, (rows, 1), generator=g)
    tokens = (start + torch.arange(seq + 1)) % vocab
    return tokens[:, :-1], tokens[:, 1:].reshape(-1)


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schedule", choices=[*SCHEDULES, "pipedream"], default="1f1b")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.5)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    commrt.init_process_group()
    rank, world = commrt.get_rank(), commrt.get_world_size()
    per_rank = 2 if args.schedule == "interleaved" else 1
    n = world * per_rank
    parts = split(make_model(args.vocab, args.dim, args.blocks), n, by="params")
    stages = [PipelineStage(parts[s], s, n) for s in range(rank, n, world)]
    loss_fn = nn.functional.cross_entropy
    first, last = 0 in [s.stage_index for s in stages], n - 1 in [s.stage_index for s in stages]
    if args.schedule == "pipedream":
        sched = PipeDream(stages[0], args.microbatches, loss_fn, lr=args.lr, num_batches=args.steps)
        xs, ys = zip(*(batch(s, args.rows, args.seq, args.vocab) for s in range(args.steps)))
        losses: list = []
        sched.step(*((torch.cat(xs),) if first else ()), target=torch.cat(ys) if last else None, losses=losses)
        if last:
            for s in range(0, args.steps, max(1, args.steps // 10)):
                chunk = losses[s * args.microbatches:(s + 1) * args.microbatches]
                log.info("rank %d step %d loss %.4f", rank, s, float(sum(chunk) / len(chunk)))
    else:
        sched = SCHEDULES[args.schedule](stages if per_rank > 1 else stages[0], args.microbatches, loss_fn)
        opt = torch.optim.SGD([p for s in stages for p in s.module.parameters()], lr=args.lr, momentum=0.9)
        for step in range(args.steps):
            x, y = batch(step, args.rows, args.seq, args.vocab)
            opt.zero_grad()
            losses = []
            sched.step(*((x,) if first else ()), target=y if last else None, losses=losses)
            opt.step()
            if last and (step % max(1, args.steps // 10) == 0 or step == args.steps - 1):
                log.info("rank %d step %d loss %.4f", rank, step, float(sum(losses) / len(losses)))
    commrt.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
