"""Pipeline x ZeRO engines against one process: the gradient norm that clips and the non-finite
check that skips a step are the whole model's, not each stage's (each stage's engine holds only
its part of the model, reduced over its data-parallel replicas).

``pipeline_engines clip|nonfinite|interleaved``: 2 stages, PIPELINE_DP replicas of each (default 1); prints 'OK <case>' or raises.
"""
from __future__ import annotations

import os
import sys

import torch
from torch import nn

import commrt
import commrt.train
from commrt.pipeline import Interleaved1F1B, OneFOneB, PipelineStage, split
from commrt.runtime.errors import ConfigError
from tests.multirank.programs.common import assert_equal, init
from tests.multirank.programs.pipeline_job import LR, STEPS, batch, make_model

CLIP = 0.05  # below every step's norm (0.29 to 0.66): each step clips
BAD_STEP = 1  # "nonfinite": the last layer's bias gets an inf gradient at this step


def poison(model: nn.Sequential, step: list[int]) -> None:
    """An inf in the gradient of the model's last bias at BAD_STEP only: the stage holding it
    sees a non-finite gradient, the stage before it does not (its gradients are finite)."""
    model[-1].bias.register_hook(lambda g: g + float("inf") if step[0] == BAD_STEP else g)


def reference(case: str) -> nn.Sequential:
    """One process: clip by the whole model's norm; skip the whole step on a non-finite gradient."""
    model, step = make_model(), [0]
    if case == "nonfinite":
        poison(model, step)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for s in range(STEPS):
        step[0] = s
        x, y = batch(s)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if case == "clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        if all(torch.isfinite(p.grad).all() for p in model.parameters()):
            opt.step()
    return model


def run(case: str, mesh) -> None:
    pp, dp = mesh.size("pp"), mesh.size("dp")
    r, d = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    model, step = make_model(), [0]
    if case == "nonfinite":
        poison(model, step)
    part = split(model, pp, by="layers")[r]
    cfg = {"zero_optimization": {"stage": 1}, "gradient_clipping": CLIP if case == "clip" else 0.0,
           "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}}}
    engine = commrt.train.initialize(part, cfg, group=mesh.get_group("dp"))
    sched = OneFOneB(PipelineStage(engine, r, pp, group=mesh.get_group("pp")), 4, nn.functional.mse_loss)
    for s in range(STEPS):
        step[0] = s
        x, y = (t.chunk(dp)[d] for t in batch(s))
        sched.step(*((x,) if r == 0 else ()), target=y if r == pp - 1 else None)
        assert engine.step() == (case != "nonfinite" or s != BAD_STEP), f"stage {r} step {s}"
    ref = dict(reference(case).named_parameters())
    for name, p in part.named_parameters():
        assert_equal(p.detach(), ref[name].detach(), f"{case} stage {r} replica {d} {name}")
    print(f"OK {case}", flush=True)


def interleaved(mesh) -> None:
    """Engines of an interleaved pipeline (two stages a rank) cannot sum the model's norm per
    stage: clipping is refused when the schedule is built, not trained on a partial norm."""
    pp, r = mesh.size("pp"), mesh.get_local_rank("pp")
    parts = split(make_model(), 2 * pp, by="layers")
    cfg = {"zero_optimization": {"stage": 1}, "gradient_clipping": CLIP,
           "optimizer": {"type": "SGD", "params": {"lr": LR}}}
    stages = [PipelineStage(commrt.train.initialize(parts[s], cfg, group=mesh.get_group("dp")), s, 2 * pp,
                            group=mesh.get_group("pp")) for s in (r, r + pp)]
    try:
        Interleaved1F1B(stages, 4, nn.functional.mse_loss)
        raise AssertionError("an interleaved pipeline of clipping engines was built")
    except ConfigError as exc:
        assert "gradient_clipping" in str(exc), exc
    print("OK interleaved", flush=True)


def main() -> int:
    init()
    dp = int(os.environ.get("PIPELINE_DP", "1"))  # replicas of each stage
    mesh = commrt.init_device_mesh((dp, commrt.get_world_size() // dp), ("dp", "pp"))
    for case in sys.argv[1:]:
        interleaved(mesh) if case == "interleaved" else run(case, mesh)
    commrt.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
