"""Sharded checkpoints of an ``Engine``: one file per rank (msgpack metadata + raw fp32 arrays,
the parameter server's format; never pickle), loadable at the same or a different world size
and stage: a loader rebuilds each parameter's values and optimizer state from the pieces the
files hold, then keeps the range it owns.
"""
from __future__ import annotations

import glob
import os
import re

import numpy as np
import torch

from .. import distributed as dist
from .. import optim
from ..errors import ConfigError
from ..ps.durable import load_checkpoint, save_checkpoint
from .layout import Unit, pieces

FORMAT = "commrt-zero-1"
_NAME = re.compile(r"zero-rank(\d+)-of-(\d+)\.ckpt$")


def shard_state(engine) -> dict:
    z = engine.zero
    names = optim.state_names(z.spec)
    arrays = []
    for u in z.units:
        arrays.append(u.master.detach().float().clone())
        arrays += [u.state[n].clone() for n in names]
    meta = {"format": FORMAT, "rank": z.rank, "world": z.world, "stage": z.stage,
            "optimizer": z.spec.kind, "global_steps": engine.global_steps,
            "skipped_steps": engine.skipped_steps, "micro_steps": engine.micro_steps,
            "params": [[n, p_numel] for n, p_numel in zip(engine.names, _numels(engine))],
            "units": [[list(u.layout.params), list(u.layout.offsets), list(u.layout.numels),
                       u.layout.numel, u.layout.padded, u.own[0], u.own[1]] for u in z.units]}
    return {"meta": meta, "arrays": arrays}


def _numels(engine) -> list[int]:
    out = [0] * len(engine.names)
    for u in engine.zero.units:
        for i, n in zip(u.layout.params, u.layout.numels):
            out[i] = n
    return out


def save(engine, directory: str) -> str:
    os.makedirs(directory, exist_ok=True)
    st = shard_state(engine)
    path = os.path.join(directory, f"zero-rank{engine.zero.rank:05d}-of-{engine.zero.world:05d}.ckpt")
    save_checkpoint(path, st["meta"], [a.numpy() for a in st["arrays"]], [1] * len(st["arrays"]))
    dist.barrier(engine.group)
    return path


def load(engine, directory: str) -> None:
    files = sorted(glob.glob(os.path.join(directory, "zero-rank*-of-*.ckpt")))
    worlds = {int(_NAME.search(f).group(2)) for f in files}
    if len(worlds) != 1:
        raise ConfigError(f"{directory}: expected the files of one run, found world sizes {sorted(worlds) or 'none'}")
    old = worlds.pop()
    if len(files) != old:
        raise ConfigError(f"{directory}: {len(files)} shard files for a world of {old}")
    states = []  # every file: the layout may differ (world size, stage, bucket size)
    for f in files:
        meta, arrays = load_checkpoint(f)
        states.append({"meta": meta, "arrays": [torch.from_numpy(a) for a in arrays]})
    load_shard_states(engine, states)


def load_shard_states(engine, states: list[dict]) -> None:
    z = engine.zero
    names = optim.state_names(z.spec)
    want = [[n, k] for n, k in zip(engine.names, _numels(engine))]
    full = {}  # parameter index -> [values, *state] rebuilt from the pieces, plus coverage
    for st in states:
        meta = st["meta"]
        if meta.get("format") != FORMAT or meta["params"] != want or meta["optimizer"] != z.spec.kind:
            raise ConfigError("checkpoint does not match this model and optimizer "
                              f"(format {meta.get('format')}, optimizer {meta.get('optimizer')}, "
                              f"{len(meta['params'])} parameters vs {len(want)})")
        arrays = iter(st["arrays"])
        for idx, offs, numels, numel, padded, lo, hi in meta["units"]:
            lay = Unit(tuple(idx), tuple(offs), tuple(numels), numel, padded)
            values = [next(arrays) for _ in range(1 + len(names))]
            for k, a, b, start in pieces(lay, lo, hi):
                i = lay.params[k]
                slot = full.setdefault(i, [torch.zeros(numels[k]) for _ in range(1 + len(names))] +
                                       [np.zeros(numels[k], bool)])
                for dst, src in zip(slot, values):
                    dst[start:start + b - a] = src[a:b]
                slot[-1][start:start + b - a] = True
        engine.global_steps, engine.skipped_steps = meta["global_steps"], meta["skipped_steps"]
        engine.micro_steps = meta["micro_steps"]
    for u in z.units:
        for k, a, b, start in pieces(u.layout, *u.own):
            slot = full.get(u.layout.params[k])
            if slot is None or not slot[-1][start:start + b - a].all():
                raise ConfigError(f"checkpoint lacks part of parameter {engine.names[u.layout.params[k]]} "
                                  "(shard files missing?)")
            u.master[a:b].copy_(slot[0][start:start + b - a])
            for n, src in zip(names, slot[1:-1]):
                u.state[n][a:b].copy_(src[start:start + b - a])
        u.grad.zero_()
    z._publish()
