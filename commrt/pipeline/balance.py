"""Cutting a model by measured time rather than by parameter count (torchgpipe's
``balance_by_time``, DeepSpeed's profile-based partitioning): a stage's share of a step is its
compute time, and the layers that cost the most per parameter (an embedding costs little, a loss
over a vocabulary a lot) skew a parameter-balanced cut. Each layer's forward and backward is
timed on one sample micro-batch; every rank of an initialised world then takes the mean over
the ranks, so all cut the model at the same places (their timings differ)."""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
from torch import nn

from commrt import distributed as dist


def layer_times(model: nn.Sequential, sample: torch.Tensor, loss_fn: Callable | None = None,
                target: torch.Tensor | None = None, reps: int = 3) -> list[float]:
    """Median seconds of each layer's forward plus backward on ``sample`` (the last layer's
    with ``loss_fn(output, target)`` when given); a warm-up pass first. Leaves no gradients, and
    the model's buffers (BatchNorm's running statistics) and torch's random stream (dropout) as
    they were: the timing passes must not make the training that follows differ from a run
    that never timed."""
    buffers = [(b, b.clone()) for b in model.buffers()]
    rng = torch.get_rng_state()
    try:
        return _timed(model, sample, loss_fn, target, reps)
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        torch.set_rng_state(rng)
        for p in model.parameters():
            p.grad = None


def _timed(model, sample, loss_fn, target, reps: int) -> list[float]:
    times: list[list[float]] = [[] for _ in model]
    last = len(model) - 1
    for rep in range(reps + 1):
        x = sample
        for i, layer in enumerate(model):
            # a copy the layer may modify in place (never the caller's sample), entered as a non-leaf
            # as runtime._entries enters a received activation: in place on a leaf that requires
            # grad is torch's RuntimeError, which an nn.ReLU(inplace=True) would meet here
            inp = x.detach().clone()
            if inp.is_floating_point():
                inp.sub_(torch.zeros((), dtype=inp.dtype, requires_grad=True))
            start = time.perf_counter()
            out = layer(inp)
            scalar = loss_fn(out, target) if i == last and loss_fn is not None else None
            if scalar is not None:
                scalar.backward()
            elif out.requires_grad:
                out.backward(torch.ones_like(out))
            if rep:
                times[i].append(time.perf_counter() - start)
            x = out.detach()
    return [statistics.median(t) for t in times]


def agreed(times: list[float]) -> list[float]:
    """The mean over the world's ranks (bit-identical on every rank), or ``times`` alone."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return times
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()
