"""A deterministic parameter-server training job: each worker computes the MSE gradient of a
small model on its own batch for step t, pushes it and pulls the new weights. The test
recomputes the same steps in one process on the global batch.

    ps_job OUT_DIR STEPS [--die-at K] [--marker-at K] [--sleep S] [--slow-worker W]

Errors are printed as 'CAUGHT <type>: <message>' with the time it took to surface.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

from commrt.runtime.config import load_config
from commrt.runtime.errors import CommError
from commrt.ps import PSClient

BATCH = 4


def make_params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w1": torch.randn(12, 9, generator=g) * 0.3, "b1": torch.zeros(9),
            "w2": torch.randn(9, 5, generator=g) * 0.3, "b2": torch.randn(5, generator=g) * 0.1}


def batch(worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * worker + step)
    x = torch.randn(BATCH, 12, generator=g)
    return x, torch.sin(x[:, :5]) + 0.1 * x[:, 5:10]


def loss_of(params: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(x @ params["w1"] + params["b1"])
    return ((h @ params["w2"] + params["b2"] - y) ** 2).mean()


def grads_of(params: dict, x, y) -> dict[str, torch.Tensor]:
    live = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    loss_of(live, x, y).backward()
    return {k: v.grad for k, v in live.items()}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("steps", type=int)
    p.add_argument("--die-at", type=int, default=-1, help="the last worker exits (cleanly) at this step")
    p.add_argument("--marker-at", type=int, default=-1, help="worker 0 touches OUT/marker at this step")
    p.add_argument("--sleep", type=float, default=0.0)
    args = p.parse_args()
    torch.set_num_threads(1)
    client = PSClient(load_config())
    worker, workers = client.worker, client.cfg.ps.workers
    params = make_params()
    client.init(params)
    client.pull(params)
    t0 = time.monotonic()
    try:
        for step in range(client.step, args.steps):
            if worker == workers - 1 and step == args.die_at:
                print(f"worker {worker} leaving at step {step}", flush=True)
                os._exit(0)
            if worker == 0 and step == args.marker_at:
                open(os.path.join(args.out, "marker"), "w").close()
            time.sleep(args.sleep)
            t0 = time.monotonic()
            client.push_pull(grads_of(params, *batch(worker, step)), params)
    except CommError as exc:
        print(f"CAUGHT {type(exc).__name__}: {exc} (detected after {time.monotonic() - t0:.2f}s)", flush=True)
        return 0
    np.save(os.path.join(args.out, f"params-{worker}.npy"),
            np.concatenate([v.numpy().ravel() for v in params.values()]), allow_pickle=False)
    if worker == 0:
        print("STATS", client.stats(), flush=True)
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
