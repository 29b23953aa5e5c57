"""Training under ``commrt launch --nnodes MIN:MAX`` (issue 33 item 1): ZeRO stage 1 with SGD +
momentum on a fixed global batch of 12 rows per step, split over however many ranks this
generation has; a complete checkpoint (train/checkpoint.py: per-rank files + marker) after every
step in DIR/step-NNNNN; a generation resumes from the newest complete one, re-sharding the
momentum to its world size. Rank 0 appends one JSON line per completed step to DIR/progress.jsonl
and, at the end, writes the full parameters to DIR/final.json (JSON: nothing pickled).

    elastic_job DIR STEPS [SECONDS_PER_STEP]
"""
from __future__ import annotations

import glob
import json
import os
import sys
import time

import torch
from torch import nn

import commrt
from commrt.runtime.errors import ConfigError
from commrt.train import checkpoint, initialize

BATCH = 12  # divisible by every world size the tests use (1, 2, 3)
OPT = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 4, generator=g)


def reference(steps: int) -> dict[str, list]:
    """Plain torch, one process, the whole batch of every step."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=OPT["params"]["lr"], momentum=OPT["params"]["momentum"])
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return {k: v.flatten().tolist() for k, v in model.state_dict().items()}


def newest_complete(directory: str) -> str | None:
    for d in sorted(glob.glob(os.path.join(directory, "step-*")), reverse=True):
        try:
            checkpoint.complete_set(d)
            return d
        except ConfigError:
            continue  # a save that a lost node cut short: the one before is complete
    return None


def main() -> int:
    directory, steps = sys.argv[1], int(sys.argv[2])
    pause = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    commrt.init_process_group()
    rank, world = commrt.get_rank(), commrt.get_world_size()
    gen = int(os.environ.get("COMMRT_ELASTIC_GENERATION", "0"))
    engine = initialize(make_model(), {"zero_optimization": {"stage": 1}, "optimizer": OPT})
    found = newest_complete(directory)
    if found:
        checkpoint.load(engine, found)
    start = engine.global_steps
    print(f"ELASTIC generation {gen} world {world} resumes at step {start}", flush=True)
    per = BATCH // world
    for step in range(start, steps):
        x, y = batch(step)
        loss = nn.functional.mse_loss(engine(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per])
        engine.backward(loss)
        engine.step()
        checkpoint.save(engine, os.path.join(directory, f"step-{step + 1:05d}"))
        if rank == 0:
            with open(os.path.join(directory, "progress.jsonl"), "a") as fh:
                fh.write(json.dumps({"generation": gen, "world": world, "step": step + 1, "time": time.time()}) + "\n")
        time.sleep(pause)
    full = {k: v.flatten().tolist() for k, v in engine.full_state_dict().items()}  # a collective
    if rank == 0:
        with open(os.path.join(directory, "final.json.tmp"), "w") as fh:
            json.dump(full, fh)
        os.replace(os.path.join(directory, "final.json.tmp"), os.path.join(directory, "final.json"))
    commrt.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
