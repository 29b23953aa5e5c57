"""Train a small transformer language model with the commrt engine (any ZeRO stage) on synthetic
data, and print loss, step time and memory per rank.

    commrt launch -n 2 -- python -m commrt.apps.train_lm --stage 3 --steps 30
    commrt launch -n 4 --config cluster.toml -- python -m workers.train_lm   # [train] table

(``python -m workers.train_lm`` from the repository root is the same program.)

The synthetic corpus has structure to learn: each sequence counts upward modulo the vocabulary
from a random start, so the next token is predictable and the loss falls well below log(vocab).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import resource
import sys
import time

import torch
from torch import nn

import commrt
from commrt.apps import reporter
from commrt.train import initialize
from commrt.train.breakdown import StepBreakdown
from commrt.train.collector import ManualGC
from commrt.train.config import load_train_config
from commrt.train.replica_ft import ReplicaFT
from commrt.train.replica_group import group_size, layout
from commrt.train.replica_state import make_optimizer


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.down(nn.functional.gelu(self.up(self.ln2(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def batch(rank: int, step: int, size: int, seq: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    start = torch.randint(0, vocab, (size, 1), generator=g)
    return (start + torch.arange(seq + 1)) % vocab


def _write_stats(path: str, engine, first: dict | None, last: dict, steps: int) -> None:
    per_step, first = {}, first or {"by_op": {}}
    for op, entry in last["by_op"].items():
        before = first["by_op"].get(op, {})
        per_step[op] = {k: (v - before.get(k, 0)) / max(steps, 1) for k, v in entry.items()}
    out = {"memory": engine.memory_report(), "units": [u.layout.numel for u in engine.zero.units],
           "per_step_by_op": per_step, "plan": list(engine.plan)}
    with open(path, "w") as fh:
        json.dump(out, fh)


def mean_breakdown(steps: list[StepBreakdown]) -> StepBreakdown:
    """The field-wise mean of several steps' breakdowns."""
    out = StepBreakdown()
    for f in dataclasses.fields(out):
        setattr(out, f.name, sum(getattr(b, f.name) for b in steps) / max(len(steps), 1))
    return out


def check_args(args) -> str | None:
    """What is wrong with the options, said before any rank starts (None: nothing). Each of
    these used to fail later and elsewhere: --heads not dividing --dim in the first forward's
    view, --log-every 0 as a ZeroDivisionError on rank 0, --steps 0 after training (no step
    times to take the median of)."""
    positive = ("steps", "batch", "seq", "vocab", "dim", "heads", "log_every")
    bad = [f"--{k.replace('_', '-')} {getattr(args, k)}" for k in positive if getattr(args, k) < 1]
    if bad or args.layers < 0:
        return f"{', '.join(bad + ([f'--layers {args.layers}'] if args.layers < 0 else []))}: must be >= 1 " \
               "(--layers >= 0)"
    if args.dim % args.heads:
        return f"--dim {args.dim} is not a multiple of --heads {args.heads} (each head takes dim / heads)"
    if args.stage is not None and args.stage not in (0, 1, 2, 3):
        return f"--stage {args.stage} is invalid; valid: 0, 1, 2, 3"
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", type=int, help="ZeRO stage (overrides the config's [train])")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--stats-json", help="write this rank's memory report, unit sizes and bytes sent per step "
                   "after the first (by op, inside / across nodes) to PATH.RANK.json (what commrt estimate predicts)")
    p.add_argument("--out", help="replica mode: write PATH.RANK.json (the replicas each applied step averaged, "
                   "counts, step times) and PATH.RANK.pt (the final parameters)")
    args = p.parse_args(argv)
    problem = check_args(args)
    if problem:
        p.error(problem)
    torch.set_num_threads(1)
    cfg = load_train_config(os.environ.get("COMMRT_CONFIG"))
    if cfg.fault_tolerance == "replica":
        return train_replicas(args, cfg)
    commrt.init_process_group()
    rank, world = commrt.get_rank(), commrt.get_world_size()
    log = reporter(__name__, f"rank {rank}")
    if args.stage is not None:
        cfg = cfg.with_stage(args.stage)
    torch.manual_seed(0)
    model = TinyLM(args.vocab, args.dim, args.layers, args.heads, args.seq)
    n_params = sum(p.numel() for p in model.parameters())
    engine = initialize(model, cfg)
    loss_fn = nn.CrossEntropyLoss()
    times, first, breakdowns = [], None, []
    for step in range(args.steps):
        tokens = batch(rank, step, args.batch, args.seq, args.vocab)
        start = time.perf_counter()
        for _ in range(cfg.gradient_accumulation_steps):
            logits = engine(tokens[:, :-1])
            loss = loss_fn(logits.reshape(-1, args.vocab).float(), tokens[:, 1:].reshape(-1))
            engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - start)
        breakdowns.append(engine.step_breakdown())
        if step == 0:  # later steps are the steady state (groups and the stage-3 order are set up)
            engine.settle()  # overlap_step: the step's bytes counted in it (a warm-up step: not timed)
            first = commrt.comm_stats()
        if rank == 0 and ((step + 1) % args.log_every == 0 or step == 0):
            log.info("step %4d loss %.4f step time %7.1f ms", step + 1, loss.item(), 1000 * times[-1])
    engine.settle()  # the last step's replica all-reduces, in its bytes
    mem = engine.memory_report()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    steady = sorted(times[len(times) // 3:])[len(times[len(times) // 3:]) // 2]  # median after warm-up
    mib = {k: mem[k] / 2**20 for k in ("total", "parameters", "gradients", "optimizer_state", "gathered_peak")}
    log.info("world %d, stage %d: %.2fM params, median step %.1f ms, model state %.1f MiB (params %.1f, grads "
             "%.1f, optimizer %.1f, gathered peak %.1f), peak RSS %.0f MiB", world, cfg.zero.stage,
             n_params / 1e6, 1000 * steady, mib["total"], mib["parameters"], mib["gradients"],
             mib["optimizer_state"], mib["gathered_peak"], rss)
    if rank == 0 and breakdowns[-1] is not None:
        log.info("step breakdown, mean after warm-up: %s", mean_breakdown(breakdowns[len(breakdowns) // 3:]))
    sent = commrt.comm_stats()
    if args.stats_json:
        _write_stats(f"{args.stats_json}.{rank}.json", engine, first, sent, args.steps - 1)
    # per step after the first: the first also carries the set-up (the initial broadcast of the
    # parameters, the hierarchical probe), which at 2 x 2 is several steps' worth of bytes
    later = max(args.steps - 1, 1)
    inside, across = ((sent[k] - (first[k] if args.steps > 1 else 0)) / later / 2**20
                      for k in ("intra_node_bytes", "inter_node_bytes"))
    log.info("sent per step after the first %.2f MiB inside the node, %.2f MiB to other nodes "
             "(first step and set-up: %.2f / %.2f MiB)", inside, across,
             first["intra_node_bytes"] / 2**20, first["inter_node_bytes"] / 2**20)
    commrt.destroy_process_group()
    return 0


def train_replicas(args, cfg) -> int:
    """``[train] fault_tolerance = "replica"``: each replica (a rank, or with HYBRID_SHARD / MiCS /
    hpZ a group of ``group_size`` consecutive ranks, a node) may die and come back
    (commrt/train/replica_ft.py). The store is COMMRT_FT_STORE (host:port, served outside the
    replicas), else rank 0 serves it at MASTER_ADDR:MASTER_PORT and its death ends the job."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    shards = group_size(cfg.zero, node)
    replica, replicas, shard = layout(rank, world, shards, node)
    store = os.environ.get("COMMRT_FT_STORE")
    log = reporter(__name__, f"replica {replica}" + (f" rank {shard}" if shards > 1 else ""))
    torch.manual_seed(0)
    model = TinyLM(args.vocab, args.dim, args.layers, args.heads, args.seq)
    # a group steps an optimizer over each rank's flat slice (replica_group.py): made from it
    optimizer = (functools.partial(make_optimizer, cfg.optimizer) if shards > 1
                 else make_optimizer(cfg.optimizer, model.parameters()))
    ft = ReplicaFT(model, optimizer, replica, replicas,
                   store or f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                   serve_store=store is None and rank == 0, shard=shard, shards=shards)
    collector = ManualGC(cfg.manual_gc_interval)  # [train] manual_gc_interval, as the engine
    try:
        times = _replica_steps(args, rank, model, ft, collector, log)
    finally:
        collector.close()
    stats = commrt.comm_stats()["replica_ft"]
    steady = sorted(times[len(times) // 3:])
    log.info("median step %.1f ms; per step (ms): %s", 1000 * steady[len(steady) // 2] if steady else 0.0,
             ", ".join(f"{k} {1000 * v / max(len(times), 1):.2f}" for k, v in stats["time_s"].items()))
    log.info("replica stats: %s", stats)
    if args.out:
        _write_replica_out(f"{args.out}.{rank}", model, ft, times)
    ft.close()
    return 0


def _replica_steps(args, rank: int, model: nn.Module, ft: ReplicaFT, collector: ManualGC, log) -> list[float]:
    """Train until ``args.steps``; each step's seconds."""
    loss_fn, step, times = nn.CrossEntropyLoss(), ft.start(), []
    while step < args.steps:
        tokens = batch(rank, step, args.batch, args.seq, args.vocab)
        start = time.perf_counter()
        loss = loss_fn(model(tokens[:, :-1]).reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        step = ft.step()
        collector.step(at=step)  # the job's step: every replica collects at the same one
        times.append(time.perf_counter() - start)
        if step % args.log_every == 0 or step == 1:
            log.info("step %4d loss %.4f step time %7.1f ms, replicas %s", step, loss.item(),
                     1000 * times[-1], ft.stats()["members"])
    return times


def _write_replica_out(path: str, model: nn.Module, ft: ReplicaFT, times: list[float]) -> None:
    """PATH.json (per applied step, the replicas it averaged; counts; step times) and PATH.pt
    (the final parameters), for tests and the overhead script."""
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, path + ".pt")
    with open(path + ".json", "w") as fh:
        json.dump({"history": [[s, list(c)] for s, c in ft.history], "stats": ft.stats(), "times": times}, fh)


if __name__ == "__main__":
    sys.exit(main())
