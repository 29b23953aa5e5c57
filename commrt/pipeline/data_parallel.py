"""2-D parallelism, pipeline x data parallel: every stage has replicas on a data-parallel group,
and each replica trains on its own share of the global batch.

The stage's module is wrapped the usual way before it goes into ``PipelineStage``:

    mesh = commrt.init_device_mesh((dp, pp), ("dp", "pp"))
    part = split(model, pp)[mesh.get_local_rank("pp")]
    module = DataParallel(part, group=mesh.get_group("dp"))                 # or ZeRO:
    module = commrt.train.initialize(part, {"zero_optimization": {"stage": 1}, ...}, group=mesh.get_group("dp"))
    stage = PipelineStage(module, mesh.get_local_rank("pp"), pp, group=mesh.get_group("pp"))

A schedule runs a stage's backward once per micro-batch; its replicas must reduce only the sum,
once. So every backward but the stage's last of the step runs under the wrapper's ``no_sync()``
(gradients accumulate locally), and the last one reduces, its buckets starting from the gradient
hooks while that backward still runs (the wrapper's own overlap). The caller steps its optimizer
(or ``engine.step()``) after ``schedule.step()`` as in plain data parallelism. Works for every
schedule that runs ``B`` actions: GPipe, 1F1B and interleaved (one wrapper per stage).
Engines also agree on each step's gradient norm and non-finite check over the pipeline
(``agree_on_steps``). A plain DataParallel stage's optimizer is the caller's: clipping it by
``clip_grad_norm_`` there would use the stage's own norm.
"""
from __future__ import annotations

import contextlib

import torch

from commrt.runtime.errors import ConfigError
from commrt.train import DataParallel, Engine


def replicated(module) -> bool:
    """Whether ``module`` reduces gradients over a data-parallel group."""
    return isinstance(module, (DataParallel, Engine))


def check(module) -> None:
    """An engine must reduce each step's gradients as they are: no accumulation of its own."""
    if isinstance(module, Engine) and module.cfg.gradient_accumulation_steps != 1:
        raise ConfigError("a pipeline stage's engine needs gradient_accumulation_steps = 1 (the schedule's "
                          f"micro-batches are the accumulation); got {module.cfg.gradient_accumulation_steps}")


def agree_on_steps(stages: list, group) -> None:
    """Each stage's engine steps on the whole model's gradient norm and non-finite check, summed
    over the pipeline ``group`` (Engine.reduce_norm_over), as one process clips and skips: each
    engine sees only its stage's part. Every stage must then be an engine. With several stages
    on a rank (interleaved) the per-rank sums would pair the wrong stages: clipping is refused."""
    engines = [st.module for st in stages if isinstance(st.module, Engine)]
    if not engines or stages[0].num_stages == 1:
        return
    if len(stages) > 1:
        if any(e.cfg.gradient_clipping > 0 for e in engines):
            raise ConfigError("gradient_clipping needs the whole model's norm, which engines of an interleaved "
                              "pipeline (several stages a rank) do not combine; use GPipe or OneFOneB, or no clipping")
        return
    engines[0].reduce_norm_over(group)


def backward(module, outputs: list[torch.Tensor], grads: list[torch.Tensor] | None, sync: bool) -> None:
    """``torch.autograd.backward(outputs, grads)`` through ``module``'s replica wrapper, if any;
    ``sync=False`` keeps the gradients local (the wrapper's ``no_sync``)."""
    if not replicated(module):
        torch.autograd.backward(outputs, grads)
        return
    ctx = contextlib.nullcontext() if sync else module.no_sync()
    with ctx:
        if isinstance(module, Engine):
            # the engine's backward takes a scalar (it resets and flushes its buckets around it);
            # sum(o * g) has gradient exactly g with respect to o
            loss = outputs[0] if grads is None else sum((o * g).sum() for o, g in zip(outputs, grads))
            module.backward(loss)
        else:
            torch.autograd.backward(outputs, grads)
