"""The engine's learning-rate schedules at stages 0 and 3 against single-process torch
(torch.optim.AdamW + torch.optim.lr_scheduler.LambdaLR with the same function of the step), a
resume from a checkpoint half-way through the schedule, and ranks that set different rates.
``python -m tests.multirank.programs.lr_job``; prints 'OK <what>' or raises."""
from __future__ import annotations

import os
import sys

import torch
from torch import nn

import commrt
from commrt.optim.schedules import lr_at
from commrt.runtime.errors import ConfigError
from commrt.train import TrainConfig, initialize
from tests.multirank.programs.zero_job import compare, data, make_model

ADAMW = {"type": "AdamW", "params": {"lr": 0.05, "weight_decay": 0.01}}
SCHEDULES = {"WarmupDecayLR": {"warmup_max_lr": 0.05, "warmup_min_lr": 0.001, "warmup_num_steps": 3,
                               "total_num_steps": 8, "warmup_type": "linear"},
             "WarmupCosineLR": {"warmup_num_steps": 2, "total_num_steps": 6, "warmup_min_ratio": 0.1}}
STEPS = 6


def config(stage: int, kind: str, **zero) -> dict:
    return {"zero_optimization": {"stage": stage, "reduce_bucket_size": 40, **zero}, "optimizer": ADAMW,
            "scheduler": {"type": kind, "params": SCHEDULES[kind]}}


def reference(world: int, kind: str) -> tuple[dict, list[float]]:
    """torch on the global batch; the rate of each step as LambdaLR set it."""
    sched = TrainConfig.from_dict(config(0, kind)).scheduler
    base = ADAMW["params"]["lr"]
    model = make_model()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], foreach=False, **ADAMW["params"])
    lam = torch.optim.lr_scheduler.LambdaLR(opt, lambda n: lr_at(sched, n, base) / base)
    lrs = []
    for step in range(STEPS):
        lrs.append(opt.param_groups[0]["lr"])
        opt.zero_grad()
        xs, ys = zip(*(data(r, step) for r in range(world)))
        nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
        lam.step()
    return {n: p.detach() for n, p in model.named_parameters()}, lrs


def train(engine, rank: int, steps: range, lrs: list[float], what: str) -> None:
    for step in steps:
        if abs(engine.get_lr()[0] - lrs[step]) > 1e-12:
            raise AssertionError(f"{what}: step {step + 1} runs at {engine.get_lr()[0]}, torch's at {lrs[step]}")
        x, y = data(rank, step)
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()


def scheduled_case(rank: int, world: int) -> None:
    for stage in (0, 3):
        for kind in SCHEDULES:
            want, lrs = reference(world, kind)
            engine = initialize(make_model(), config(stage, kind))
            train(engine, rank, range(STEPS), lrs, f"stage {stage} {kind}")
            compare(engine.full_state_dict(), want, f"stage {stage} {kind}", atol=1e-6)
            engine.close()


def resume_case(rank: int, world: int) -> None:
    """Half the steps, a checkpoint, a new engine on a fresh model loading it, the other half."""
    directory = os.path.join(os.environ["COMMRT_TEST_TMP"], "lr-ckpt")
    for stage in (0, 3):
        want, lrs = reference(world, "WarmupDecayLR")
        first = initialize(make_model(), config(stage, "WarmupDecayLR"))
        train(first, rank, range(STEPS // 2), lrs, f"stage {stage} before the checkpoint")
        first.save_checkpoint(directory)
        first.close()
        second = initialize(make_model(), config(stage, "WarmupDecayLR"))
        second.load_checkpoint(directory)
        train(second, rank, range(STEPS // 2, STEPS), lrs, f"stage {stage} resumed")
        compare(second.full_state_dict(), want, f"stage {stage} resumed schedule", atol=1e-6)
        second.close()


def disagree_case(rank: int, world: int) -> None:
    """Ranks that set different rates: every rank raises before any update, then agrees again."""
    engine = initialize(make_model(), {"optimizer": ADAMW})
    before = engine.full_state_dict()
    engine.set_lr(0.01 * (rank + 1))
    x, y = data(rank, 0)
    engine.backward(nn.functional.mse_loss(engine(x), y))
    try:
        engine.step()
    except ConfigError as exc:
        assert "learning rates differ" in str(exc), exc
    else:
        raise AssertionError("ranks with different learning rates stepped")
    compare(engine.full_state_dict(), before, "different learning rates refused", atol=0.0)
    engine.close()


def hybrid_case(rank: int, world: int) -> None:
    """HYBRID_SHARD with overlap_step (zero_defer: each unit steps at its next gather, with the
    settings of the step() that made it due) and hpZ: the same rates as torch's."""
    for name, zero in (("HYBRID_SHARD", {"sharding_strategy": "HYBRID_SHARD", "shard_group_size": 2}),
                       ("hpZ", {"zero_hpz_partition_size": 2})):
        want, lrs = reference(world, "WarmupDecayLR")
        engine = initialize(make_model(), config(3, "WarmupDecayLR", **zero))
        train(engine, rank, range(STEPS), lrs, name)
        assert name != "HYBRID_SHARD" or engine.zero.deferred_steps == STEPS, "overlap_step did not defer"
        compare(engine.full_state_dict(), want, f"{name} WarmupDecayLR", atol=1e-6)
        engine.close()


def main() -> int:
    torch.set_num_threads(1)
    commrt.init_process_group()
    rank, world = commrt.get_rank(), commrt.get_world_size()
    if sys.argv[1:] == ["hybrid"]:
        hybrid_case(rank, world)
        commrt.destroy_process_group()
        return 0
    scheduled_case(rank, world)
    resume_case(rank, world)
    disagree_case(rank, world)
    commrt.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
