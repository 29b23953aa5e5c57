"""Sharded checkpoints of an ``Engine``: one file per rank (msgpack metadata + raw fp32 arrays,
the parameter server's format; never pickle), loadable at the same or a different world size
and stage: a loader rebuilds each parameter's values and optimizer state from the pieces the
files hold, then keeps the range it owns. Each file also holds its rank's frozen parameters and
persistent buffers (``module_state``); a load takes its own rank's at the same world size, else
rank 0's.

A save is complete only once rank 0 has written the marker ``zero-complete.json`` (last, after
every rank's file is on disk): it names the step, the world size and each rank file's SHA-256.
Each save writes its rank files into a new subdirectory (``save-<k>``, k one more than the
marker's), never over the files of the save the marker names: the marker's rename is the switch,
so a job killed at any point leaves the previous complete save loadable; rank 0 then removes the
older subdirectories. Every file and the marker go through a temporary file, fsync and rename. A
load reads exactly
the files the marker names and refuses a set without a marker (a save that never finished) or
with a file the marker does not describe (a crash part-way through a later save mixed steps).
"""
from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import shutil

import numpy as np
import torch

from commrt import distributed as dist
from commrt.optim import rules as optim
from commrt.runtime.errors import ConfigError
from commrt.ps.durable import load_checkpoint, save_checkpoint
from commrt.train.layout import Unit, pieces
from commrt.train.zero_step import drop_grads

FORMAT = "commrt-zero-1"
MARKER = "zero-complete.json"

log = logging.getLogger(__name__)


def module_state(module) -> dict[str, torch.Tensor]:
    """What the model holds outside the engine's shards: frozen parameters and persistent
    buffers (BatchNorm's running statistics), by their state_dict names. Each rank's own (the
    engine never averages buffers), as DeepSpeed saves rank 0's module state beside the shards."""
    keys = module.state_dict(keep_vars=True)
    return {n: t for n, t in keys.items() if not (isinstance(t, torch.nn.Parameter) and t.requires_grad)}


def shard_state(engine) -> dict:
    z = engine.zero
    names = optim.state_names(z.spec)
    arrays = []
    for u in z.units:
        arrays.append(u.master.detach().float().clone())
        arrays += [u.state[n].clone() for n in names]
    extra = module_state(engine.module)
    # as fp32 (bf16 and fp16 fit) or int64 (counters, masks): two dtypes every file can hold
    arrays += [t.detach().reshape(-1).to(torch.float32 if t.is_floating_point() else torch.int64, copy=True)
               for t in extra.values()]
    meta = {"format": FORMAT, "rank": z.rank, "world": z.world, "stage": z.stage,
            "module_state": [[n, list(t.shape), t.is_floating_point()] for n, t in extra.items()],
            "optimizer": z.spec.kind, "optimizer_state": list(names), "global_steps": engine.global_steps,
            "lr": z.spec.lr,
            "skipped_steps": engine.skipped_steps, "micro_steps": engine.micro_steps,
            "params": [[n, p_numel] for n, p_numel in zip(engine.names, _numels(engine))],
            "shapes": _shapes(engine),
            "units": [[list(u.layout.params), list(u.layout.offsets), list(u.layout.numels),
                       u.layout.numel, u.layout.padded, u.own[0], u.own[1]] for u in z.units]}
    return {"meta": meta, "arrays": arrays}


def _numels(engine) -> list[int]:
    out = [0] * len(engine.names)
    for u in engine.zero.units:
        for i, n in zip(u.layout.params, u.layout.numels):
            out[i] = n
    return out


def _shapes(engine) -> list[list[int]]:
    out = [[]] * len(engine.names)
    for u in engine.zero.units:
        for i, shape in zip(u.layout.params, u.shapes):
            out[i] = list(shape)
    return out


def file_name(rank: int, world: int) -> str:
    return f"zero-rank{rank:05d}-of-{world:05d}.ckpt"


def save(engine, directory: str) -> str:
    z = engine.zero
    sub = _next_subdir(directory, engine.group)
    os.makedirs(os.path.join(directory, sub), exist_ok=True)
    st = shard_state(engine)
    path = os.path.join(directory, sub, file_name(z.rank, z.world))
    save_checkpoint(path, st["meta"], [a.numpy() for a in st["arrays"]],
                    [1 if a.is_floating_point() else 8 for a in st["arrays"]])  # float32 / int64
    mine = torch.frombuffer(bytearray(_sha256(path)), dtype=torch.uint8)
    digests = torch.empty(32 * z.world, dtype=torch.uint8)
    dist.all_gather_into_tensor(digests, mine, group=engine.group)  # also: every file is written
    if z.rank == 0:
        files = {file_name(r, z.world): bytes(digests[32 * r:32 * r + 32].tolist()).hex() for r in range(z.world)}
        write_marker(directory, {"format": FORMAT, "global_steps": engine.global_steps, "world": z.world,
                                 "files": files, "dir": sub})
        _remove_older(directory, sub)
    dist.barrier(engine.group)  # nobody returns before the save is complete
    return path


def _next_subdir(directory: str, group) -> str:
    """``save-<k>``: k one more than the complete save's (rank 0 reads the marker, every rank
    takes its answer), so a save never writes into the directory the marker names."""
    k = torch.zeros(1, dtype=torch.int64)
    if dist.get_rank(group) == 0:
        os.makedirs(directory, exist_ok=True)
        try:
            with open(os.path.join(directory, MARKER)) as fh:
                last = str(json.load(fh).get("dir", "save-0"))
            k[0] = int(last.rsplit("-", 1)[-1]) + 1 if last.startswith("save-") else 1
        except (OSError, ValueError, AttributeError):
            k[0] = 1  # no complete save here (or an unreadable marker, which no load accepts)
    dist.broadcast(k, group.ranks[0] if group is not None else 0, group)
    return f"save-{int(k[0])}"


def _remove_older(directory: str, keep: str) -> None:
    """After the switch: the earlier saves' subdirectories and rank files (never loaded again)."""
    for old in glob.glob(os.path.join(directory, "save-*")):
        if os.path.basename(old) != keep:
            shutil.rmtree(old, ignore_errors=True)
    for old in glob.glob(os.path.join(directory, "zero-rank*-of-*.ckpt")):
        os.remove(old)


def _sha256(path: str) -> bytes:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.digest()


def write_marker(directory: str, doc: dict) -> None:
    """The completion marker, written like every checkpoint file: temporary file, fsync, rename."""
    path = os.path.join(directory, MARKER)
    with open(path + ".tmp", "w") as fh:
        json.dump(doc, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(path + ".tmp", path)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def complete_set(directory: str) -> tuple[dict, list[str]]:
    """(marker, paths of the rank files it names, in rank order), or a ConfigError that says
    why the set in ``directory`` is not one complete save and names the offending files."""
    try:
        with open(os.path.join(directory, MARKER)) as fh:
            doc = json.load(fh)
    except FileNotFoundError:
        present = sorted(os.path.relpath(f, directory) for f in glob.glob(os.path.join(directory, "**", "zero-rank*.ckpt"),
                                                                         recursive=True))
        raise ConfigError(f"{directory}: no {MARKER}, so no save there completed (interrupted, or written "
                          f"before completion markers); refusing {present or 'an empty set'}") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{directory}/{MARKER} is unreadable: {exc}") from None
    sub = doc.get("dir", "") if isinstance(doc, dict) else ""  # saves before subdirectories: ""
    if not isinstance(sub, str) or os.sep in sub or sub.startswith("."):
        raise ConfigError(f"{directory}/{MARKER} names no subdirectory of it: {sub!r:.100}")
    directory = os.path.join(directory, sub) if sub else directory
    present = sorted(os.path.basename(f) for f in glob.glob(os.path.join(directory, "zero-rank*-of-*.ckpt")))
    world, files = doc.get("world"), doc.get("files")
    if (doc.get("format") != FORMAT or not isinstance(world, int) or world < 1 or not isinstance(files, dict)
            or sorted(files) != [file_name(r, world) for r in range(world)]):
        raise ConfigError(f"{directory}/{MARKER} does not describe a {FORMAT} save: {doc!r:.300}")
    missing = [n for n in sorted(files) if n not in present]
    differ = [n for n in sorted(files) if n in present and _sha256(os.path.join(directory, n)).hex() != files[n]]
    if missing or differ:
        raise ConfigError(f"{directory}: not the complete save of step {doc.get('global_steps')} (world {world}) "
                          f"that {MARKER} records: missing {missing}, differing from it {differ} (a later save "
                          "interrupted part-way, or files from another save)")
    extra = sorted(set(present) - set(files))
    if extra:
        log.warning("%s: ignoring %s, not part of the completed save of step %s", directory, extra,
                    doc.get("global_steps"))
    return doc, [os.path.join(directory, n) for n in sorted(files)]


def load(engine, directory: str) -> None:
    doc, files = complete_set(directory)
    states = []  # every file: the layout may differ (world size, stage, bucket size)
    for rank, f in enumerate(files):
        meta, arrays = load_checkpoint(f)
        if (meta.get("rank"), meta.get("world"), meta.get("global_steps")) != (rank, doc["world"], doc["global_steps"]):
            raise ConfigError(f"{f}: rank {meta.get('rank')} of {meta.get('world')} at step "
                              f"{meta.get('global_steps')}, but {MARKER} records rank {rank} of {doc['world']} "
                              f"at step {doc['global_steps']}")
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
        _check_state_names(meta, names)
        _check_shapes(meta, engine)
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
        engine.resume_lr(meta.get("lr"))  # the schedule's at the loaded step, or the saved rate
        st["module_state"] = list(arrays)  # what follows the units
    # this rank's own file at the same world size (an exact continuation), else rank 0's
    own = [st for st in states if st["meta"].get("rank") == z.rank and st["meta"].get("world") == z.world]
    _load_module_state(engine, (own or states)[0])
    for u in z.units:
        for k, a, b, start in pieces(u.layout, *u.own):
            slot = full.get(u.layout.params[k])
            if slot is None or not slot[-1][start:start + b - a].all():
                raise ConfigError(f"checkpoint lacks part of parameter {engine.names[u.layout.params[k]]} "
                                  "(shard files missing?)")
            u.master[a:b].copy_(slot[0][start:start + b - a])
            for n, src in zip(names, slot[1:-1]):
                u.state[n][a:b].copy_(src[start:start + b - a])
    # the gradients of the backwards before the load belong to no step of the loaded state, at
    # any stage (stages 0-1 kept those still in p.grad, before an accumulation boundary)
    drop_grads(z)
    z.publish()


def _check_state_names(meta: dict, names: list[str]) -> None:
    """The per-element state arrays saved with each unit are the ones this optimizer keeps: SGD
    with momentum keeps a buffer, without it none, so a change of momentum between save and
    load read the arrays misaligned (a raw RuntimeError, or values taken for state). A file
    written before the names were saved is read as before."""
    saved = meta.get("optimizer_state")
    if saved is not None and list(saved) != list(names):
        raise ConfigError(f"checkpoint's optimizer state {list(saved)} differs from this optimizer's {list(names)} "
                          "(its settings changed between save and load, e.g. SGD momentum 0 vs > 0); load it "
                          "with the optimizer settings it was saved with")


def _check_shapes(meta: dict, engine) -> None:
    """Each parameter has the shape it was saved with, not only as many elements (a [4, 6]
    table read into a [6, 4] one put its values in the wrong places). A file written before
    shapes were saved is read as before."""
    saved = meta.get("shapes")
    if saved is None:
        return
    differ = [f"{n}: shape {list(a)} in the checkpoint, {b} in this model"
              for n, a, b in zip(engine.names, saved, _shapes(engine)) if list(a) != b]
    if differ or len(saved) != len(engine.names):
        raise ConfigError(f"checkpoint does not match this model's parameter shapes: {'; '.join(differ[:5])}"
                          + (f" (and {len(differ) - 5} more)" if len(differ) > 5 else ""))


def _load_module_state(engine, st: dict) -> None:
    """Frozen parameters and buffers back into the model (a checkpoint from before they were
    saved has none: the model keeps its own)."""
    saved = st["meta"].get("module_state")
    if saved is None:
        log.warning("checkpoint has no frozen parameters or buffers (written before they were saved); "
                    "the model keeps its own")
        return
    mine = module_state(engine.module)
    if sorted(n for n, _, _ in saved) != sorted(mine) or len(st["module_state"]) != len(saved):
        raise ConfigError(f"checkpoint's frozen parameters and buffers {sorted(n for n, _, _ in saved)} do not "
                          f"match this model's {sorted(mine)}")
    with torch.no_grad():
        for (name, shape, _), src in zip(saved, st["module_state"]):
            dst = mine[name]
            if list(dst.shape) != shape or src.numel() != dst.numel():
                raise ConfigError(f"checkpoint's {name} has shape {shape}, this model's {list(dst.shape)}")
            dst.copy_(src.view(dst.shape).to(dst.dtype))
