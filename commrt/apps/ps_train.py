"""Train a small MLP against the parameter servers and print loss and throughput.

    commrt launch -n 2 --servers 2 -- python -m commrt.apps.ps_train --steps 200

(``python -m workers.ps_train`` from the repository root is the same program.)

Each worker draws its own batches of a synthetic classification task (labels from a fixed random
teacher network, so the loss can really fall), pushes its gradients and pulls the new weights;
the servers run the optimizer chosen in [ps] (COMMRT_PS_OPTIMIZER, COMMRT_PS_MODE, ...).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch import nn

from commrt.apps import reporter
from commrt.runtime.config import load_config
from commrt.ps import PSClient


def make_model(dim: int, hidden: int, classes: int) -> nn.Module:
    return nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, classes))


def batches(worker: int, dim: int, classes: int, batch: int):
    teacher = torch.Generator().manual_seed(1234)
    w_true = torch.randn(dim, classes, generator=teacher)
    gen = torch.Generator().manual_seed(100 + worker)
    while True:
        x = torch.randn(batch, dim, generator=gen)
        yield x, (x @ w_true).argmax(dim=1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--classes", type=int, default=8)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--straggler", type=int, default=-1, help="this worker is slow (simulated)...")
    p.add_argument("--delay-ms", type=float, default=0.0, help="...by this much per step")
    args = p.parse_args(argv)

    torch.manual_seed(0)  # the same initial weights everywhere; worker 0's are the ones kept
    torch.set_num_threads(1)
    model = make_model(args.dim, args.hidden, args.classes)
    params = dict(model.named_parameters())
    weights = {k: v.data for k, v in params.items()}
    client = PSClient(load_config())
    try:
        client.init(weights)
        client.pull(weights)
        log = reporter(__name__, f"worker {client.worker}")
        if client.step >= args.steps:  # joined a job whose steps are all done
            log.info("nothing left to train: the job is at step %d of %d", client.step, args.steps)
        else:
            _train(client, model, weights, args, log)
        if client.worker == 0 and os.environ.get("COMMRT_PS_PRINT_STATS"):
            for s in client.stats():
                log.info("server %s: version %s pushes %s pulls %s staleness %s", s["server"], s["version"],
                         s["pushes"], s["pulls"], s["staleness"])
    finally:
        client.close()
    return 0


def _train(client: PSClient, model: nn.Module, weights: dict, args, log) -> None:
    """Steps client.step .. args.steps - 1 (a worker that joined later runs fewer)."""
    params = dict(model.named_parameters())
    worker, first = client.worker, client.step
    data = batches(worker, args.dim, args.classes, args.batch)
    loss_fn = nn.CrossEntropyLoss()
    start, window_start, first_loss = time.perf_counter(), time.perf_counter(), None
    for step in range(first, args.steps):
        x, y = next(data)
        if worker == args.straggler:
            time.sleep(args.delay_ms / 1000)
        model.zero_grad(set_to_none=False)
        loss = loss_fn(model(x), y)
        loss.backward()
        client.push_pull({k: v.grad for k, v in params.items()}, weights)
        first_loss = loss.item() if first_loss is None else first_loss
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            now = time.perf_counter()
            rate = args.log_every * args.batch / (now - window_start)
            log.info("step %5d loss %.4f %8.0f samples/s", step + 1, loss.item(), rate)
            window_start = now
    total, ran = time.perf_counter() - start, args.steps - first
    log.info("done: loss %.4f -> %.4f, %.0f samples/s, %.2f ms/step", first_loss, loss.item(),
             ran * args.batch / total, 1000 * total / ran)


if __name__ == "__main__":
    sys.exit(main())
