"""Replica fault tolerance, the state transfer: a replica that (re)joins receives the current
parameters, buffers and optimizer state from a live one over the transport, not from a
checkpoint (issue 33 item 2).

The tensors go as broadcasts from the source in the new generation's world, after their
description, msgpack (no pickle across processes) broadcast as bytes (a store value holds at
most 1 MiB, too little for a model of many tensors): for each
parameter index of the optimizer, its state's tensors (shape, dtype) and plain numbers, and each
parameter group's settings, all of them plain numbers (a scheduler may have changed the learning
rate, and OneCycleLR changes the momentum or Adam's betas too). A receiver without state
allocates the tensors from it, receives them, and loads them into its optimizer.

The tensors travel in a few large broadcasts, not one each: per wire dtype, packed in order into
flat buffers of at most ``CAP_BYTES`` (torch's ``_flatten_dense_tensors``; a larger tensor goes
alone, as it is). One broadcast per tensor cost ~80,000 broadcasts and 14 s for a model of
20,000 parameter tensors with Adam's state.
"""
from __future__ import annotations

import msgpack
import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from commrt.runtime import dtypes
from commrt.runtime.errors import ConfigError, ProtocolError

CAP_BYTES = 25 << 20  # torch DDP's bucket size: large enough that latency no longer counts


def describe(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> dict:
    """The optimizer state's layout and scalars (what a receiver needs to allocate it), and the
    layout of everything broadcast (``check`` compares a receiver's with it before any tensor)."""
    sd = optimizer.state_dict()
    state = {}
    for idx, entry in sd["state"].items():
        state[int(idx)] = {k: (["t", list(v.shape), _dtype(v)] if torch.is_tensor(v) else ["n", v])
                           for k, v in entry.items()}
    groups = [{k: v for k, v in g.items() if k != "params" and _plain(v)} for g in sd["param_groups"]]
    return {"state": state, "groups": groups, "layout": _layout(model, optimizer)}


def _dtype(t: torch.Tensor) -> str:
    return dtypes.name_of(dtypes.code_of(t.dtype))


def _layout(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The model's parameters and buffers (name, shape, dtype) in broadcast order, and the
    optimizer's kind and parameters per group."""
    named = [*model.named_parameters(), *model.named_buffers()]
    return {"tensors": [[n, list(t.shape), dtypes.dtype_name(t.dtype)] for n, t in named],
            "optimizer": type(optimizer).__name__,
            "groups": [len(g["params"]) for g in optimizer.param_groups]}


def check(model: torch.nn.Module, optimizer: torch.optim.Optimizer, desc: dict) -> None:
    """``ConfigError`` unless this replica's model and optimizer have the layout of the source's
    (a replica restarted with another model or optimizer config): the transfer would fail, or
    load state that does not fit, and being retried it would fail in every generation."""
    theirs, mine = desc["layout"], _layout(model, optimizer)
    if theirs == mine:
        return
    why = [f"{what}: the source's {theirs.get(what)}, this replica's {mine[what]}"
           for what in ("optimizer", "groups") if theirs.get(what) != mine[what]]
    tensors = theirs.get("tensors") or []
    for (name, shape, dtype), (n, s, d) in zip(tensors, mine["tensors"]):
        if [name, shape, dtype] != [n, s, d]:
            why.append(f"first differing tensor: the source's {name} {shape} {dtype}, this replica's {n} {s} {d}")
            break
    if len(tensors) != len(mine["tensors"]):
        why.append(f"{len(tensors)} parameters and buffers at the source, {len(mine['tensors'])} here")
    raise ConfigError("replica state transfer: this replica's model or optimizer differs from the running job's ("
                      + "; ".join(why) + "); start it with the job's config")


def _plain(v) -> bool:
    """A setting msgpack carries as it is: a number, bool or None, or a tuple or list of them."""
    if isinstance(v, (tuple, list)):
        return all(_plain(x) and not isinstance(x, (tuple, list)) for x in v)
    return v is None or isinstance(v, (bool, int, float))


def pack(desc: dict) -> bytes:
    return msgpack.packb(desc)


def unpack(raw: bytes) -> dict:
    desc = msgpack.unpackb(bytes(raw), strict_map_key=False)
    if not (isinstance(desc, dict) and set(desc) == {"state", "groups", "layout"} and isinstance(desc["groups"], list)
            and all(isinstance(g, dict) for g in desc["groups"]) and isinstance(desc["layout"], dict)):
        raise ProtocolError(f"replica state description is malformed: {str(desc)[:80]}")
    return desc


def tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer, desc: dict) -> tuple[list, dict]:
    """Every tensor to broadcast, in an order both sides derive alike, and the optimizer state
    dict they fill (a receiver's is freshly allocated from ``desc``; the source's is its own)."""
    out = [t.data for t in (*model.parameters(), *model.buffers())]
    mine = optimizer.state_dict()["state"]
    state = {}
    for idx in sorted(desc["state"]):
        entry = {}
        for k, (kind, *rest) in sorted(desc["state"][idx].items()):
            if kind == "n":
                entry[k] = rest[0]
                continue
            have = mine.get(idx, {}).get(k)
            shape, dtype = rest[0], dtypes.parse_dtype(rest[1])
            if have is None or list(have.shape) != shape or have.dtype != dtype:
                have = torch.empty(shape, dtype=dtype)
            entry[k] = have
            out.append(have)
        state[idx] = entry
    return out, state


def on_wire(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the transport carries it: itself, or its bytes (an int16 buffer, a dtype the wire
    lacks), the same memory, so that a broadcast into it fills ``t``."""
    try:
        dtypes.code_of(t.dtype)
        return t
    except TypeError:
        return (t if t.dim() else t.unsqueeze(0)).view(torch.uint8)


def batches(wire: list[torch.Tensor], cap: int) -> list[list[int]]:
    """The tensors' indexes grouped into broadcasts: per dtype, in order, each group at most
    ``cap`` bytes (a larger tensor is a group of its own). Both sides derive the same groups:
    their tensors' dtypes and sizes are the source's (``check``, and ``tensors`` allocates
    a receiver's optimizer state from the description)."""
    out, open_, size = [], {}, {}
    for i, t in enumerate(wire):
        n = t.numel() * t.element_size()
        if t.dtype in open_ and size[t.dtype] + n > cap:
            out.append(open_.pop(t.dtype))
        if t.dtype not in open_:
            open_[t.dtype], size[t.dtype] = [], 0
        open_[t.dtype].append(i)
        size[t.dtype] += n
    return out + list(open_.values())


def transfer(broadcast, ts: list[torch.Tensor], source: bool, cap: int | None = None) -> None:
    """Broadcast ``ts`` (from ``tensors``) with ``broadcast(flat)``: the source packs each group
    of ``batches`` into one flat buffer, the others unpack it into their tensors (bit for bit:
    only copies). A group of one tensor goes as it is, without a copy."""
    wire = [on_wire(t) for t in ts]
    for group in batches(wire, CAP_BYTES if cap is None else cap):
        if len(group) == 1:
            broadcast(wire[group[0]])
            continue
        parts = [wire[i] for i in group]
        dev = parts[0].device
        if not source:
            flat = torch.empty(sum(p.numel() for p in parts), dtype=parts[0].dtype, device=dev)
        elif all(p.device == dev for p in parts):
            flat = _flatten_dense_tensors(parts)  # one C++ call (a Python loop cost more than the transfer)
        else:
            flat = torch.cat([p.reshape(-1).to(dev) for p in parts])
        broadcast(flat)
        if not source:
            torch._foreach_copy_(parts, list(_unflatten_dense_tensors(flat, parts)))


def load(optimizer: torch.optim.Optimizer, desc: dict, state: dict) -> None:
    """Put the received state into ``optimizer``, its groups' settings included (a tuple, as
    Adam's betas, stays a tuple: msgpack sent a list)."""
    sd = optimizer.state_dict()
    sd["state"] = state
    if len(desc["groups"]) != len(sd["param_groups"]):
        raise ProtocolError(f"replica state for {len(desc['groups'])} parameter groups, this optimizer has "
                            f"{len(sd['param_groups'])}")
    for group, settings in zip(sd["param_groups"], desc["groups"]):
        for k, v in settings.items():
            group[k] = tuple(v) if isinstance(group.get(k), tuple) and isinstance(v, list) else v
        group["params"] = _Ids(group["params"])
    optimizer.load_state_dict(sd)


class _Ids(list):
    """A group's parameter indexes that answer ``in`` at once: torch's ``load_state_dict``
    asks, for every state tensor, whether its index is in the group's list (a scan), which
    for 20,000 parameters with Adam's state took longer than receiving the state."""

    def __init__(self, ids):
        super().__init__(ids)
        self._set = frozenset(ids)

    def __contains__(self, i) -> bool:
        return i in self._set


def make_optimizer(spec, params) -> torch.optim.Optimizer:
    """The torch optimizer for an ``[train] optimizer`` (an ``OptimSpec``): replica mode steps
    with torch's optimizers, whose state dicts it transfers. LAMB has none in torch."""
    if spec.kind == "adamw":
        return torch.optim.AdamW(params, lr=spec.lr, betas=(spec.beta1, spec.beta2), eps=spec.eps,
                                 weight_decay=spec.weight_decay)
    if spec.kind == "sgd":
        return torch.optim.SGD(params, lr=spec.lr, momentum=spec.momentum, nesterov=spec.nesterov,
                               weight_decay=spec.weight_decay)
    raise ConfigError(f"fault_tolerance = 'replica' steps with torch's optimizers: AdamW or SGD, not {spec.kind!r}")
