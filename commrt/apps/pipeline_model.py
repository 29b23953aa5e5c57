"""The model and stages of ``pipeline_lm`` (and of its ``--bench``, ``pipeline_bench``): an
``nn.Sequential`` (embedding, MLP blocks, output layer) cut with ``commrt.pipeline.split``, the
counting corpus, and this rank's stages under a schedule, optionally replicated over a
data-parallel group.
"""
from __future__ import annotations

import torch
from torch import nn

import commrt
import commrt.train
from commrt.pipeline import GPipe, Interleaved1F1B, OneFOneB, PipeDream, PipelineStage, split

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
    """(tokens, next tokens), both [rows, seq]: the target keeps its rows so a schedule cuts it into
    micro-batches where it cuts the tokens (flattened, it was cut at other rows whenever the
    micro-batches do not divide the rows; ``loss`` flattens it)."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, vocab, (rows, 1), generator=g)
    tokens = (start + torch.arange(seq + 1)) % vocab
    return tokens[:, :-1], tokens[:, 1:]


def loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of ``Flat``'s [rows * seq, vocab] logits against [rows, seq] tokens."""
    return nn.functional.cross_entropy(logits, target.reshape(-1))


def wrap_replicas(part: nn.Module, args, dp_group):
    """The stage's module, reducing its gradients over ``dp_group`` (None: no replicas)."""
    if dp_group is None:
        return part
    if args.dp_wrap == "zero1":
        cfg = {"zero_optimization": {"stage": 1},
               "optimizer": {"type": "SGD", "params": {"lr": args.lr, "momentum": 0.9}}}
        return commrt.train.initialize(part, cfg, group=dp_group)
    return commrt.train.DataParallel(part, group=dp_group)


def build(args, schedule: str, pp_group=None, dp_group=None, num_batches: int = 1):
    """This rank's stages and the schedule over them (``pp_group``: None for the world)."""
    ranks = commrt.get_world_size(pp_group) if pp_group is not None else commrt.get_world_size()
    rank = commrt.get_rank(pp_group) if pp_group is not None else commrt.get_rank()
    per_rank = 2 if schedule == "interleaved" else 1
    n = ranks * per_rank
    model, how = make_model(args.vocab, args.dim, args.blocks), getattr(args, "split", "params")
    if how == "time":  # one micro-batch of the first batch, the loss on the last layer
        x, y = batch(0, args.rows, args.seq, args.vocab)
        rows = max(1, args.rows // args.microbatches)
        parts = split(model, n, by="time", sample=x[:rows], loss_fn=loss, target=y[:rows])
    else:
        parts = split(model, n, by=how)
    stages = [PipelineStage(wrap_replicas(parts[s], args, dp_group), s, n, pp_group) for s in range(rank, n, ranks)]
    loss_fn, gc_every = loss, getattr(args, "manual_gc_interval", None) or 0
    if schedule == "pipedream":
        sched = PipeDream(stages[0], args.microbatches, loss_fn, lr=args.lr, num_batches=num_batches,
                          manual_gc_interval=gc_every)
    else:
        sched = SCHEDULES[schedule](stages if per_rank > 1 else stages[0], args.microbatches, loss_fn,
                                    manual_gc_interval=gc_every)
    return stages, sched, n
