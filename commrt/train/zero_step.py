"""The optimizer step of a ZeRO-sharded model: each rank steps the fp32 master values of its own
shard of every unit (``UnitState.master`` with ``UnitState.grad``), then makes the new values
visible to the model (``publish``). Functions of the engine's ``Zero`` (``zero.py``).

LAMB's trust ratio needs the norms of whole parameters, which a shard holds only parts of: the
partial squared norms of every rank are all-reduced first (``_lamb_apply``).
"""
from __future__ import annotations

import torch

from commrt import distributed as dist
from commrt.collectives.reduce_ops import ReduceOp
from commrt.optim import rules as optim
from commrt.train.layout import pieces


NORM_CHUNK = 1 << 18


def squared_norm(t: torch.Tensor) -> float:
    """The sum of squares of ``t`` in fp64 (fp32 squares cannot overflow there, so a NaN or inf
    in the result means one in ``t``), a cache-sized chunk at a time: converting a whole 30 MB
    gradient at once allocated (and page-faulted) 120 MB per step and cost 115 ms of a 350 ms
    step at 7.5M parameters, 8 ms chunked. The summation order differs from one whole-tensor
    sum by about 1e-16 relative."""
    return sum(float(c.double().square().sum()) for c in t.reshape(-1).split(NORM_CHUNK))


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or inf in ``t``. A finite sum proves it (NaN and inf survive a sum) at the cost of
    one read; only a sum that is not finite (a NaN, an inf, or an overflow of large finite
    values) pays for the element-wise check, which allocates a mask of ``t``'s size."""
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def update(z, step: int, clip_coef: float) -> None:
    """One optimizer step of every unit's own shard (``z``: the engine's ``Zero``)."""
    drop_prefetches(z)
    lamb = []
    for u in z.units:
        g = z.own_grad(u)
        if clip_coef < 1.0:
            g.mul_(clip_coef)
        if z.spec.kind == "lamb":
            lamb.append((u, optim.lamb_direction_(u.master, g, u.state, z.spec, step)))
        else:
            _step_in_chunks(u.master, g, u.state, z.spec, step)
    if lamb:
        _lamb_apply(z, lamb)
    with z.clock.span("bookkeeping"):
        publish(z)
        for u in z.units:
            u.grad.zero_()
            u.reduced, u.grad_zero = False, True


def step_unit(z, u, step: int, clip_coef: float, spec=None) -> None:
    """``update``'s arithmetic for one unit of a stage-3 model (``zero_defer``: the step of a unit
    taken just before the next forward gathers it; SGD and AdamW only, which are element-wise)."""
    g = z.own_grad(u)
    if clip_coef < 1.0:
        g.mul_(clip_coef)
    _step_in_chunks(u.master, g, u.state, spec or z.spec, step)
    u.fresh = False  # as publish: the next gather reads the new primary shards
    u.grad.zero_()
    u.reduced, u.grad_zero = False, True


def drop_grads(z) -> None:
    """Every gradient no ``step()`` consumed yet dropped (``Engine.zero_grad``): the reductions
    a backward started are waited for (a backward that raised on every rank started the same
    ones everywhere) and their results dropped with the units' gradients, the gradients that
    were not reduced yet (``p.grad``) set to None, and the units a stage-3 backward gathered
    released. A unit whose step is due (``zero_defer``) keeps its gradient: it is that step's."""
    z.wait()
    drop_prefetches(z)
    for u in z.units:
        if u.step_due is not None:
            continue
        u.grad.zero_()
        u.reduced, u.grad_zero = False, True
        for p in u.params:
            p.grad = None
    z.nonfinite = False


def _step_in_chunks(master: torch.Tensor, grad: torch.Tensor, state: dict, spec, step: int) -> None:
    """SGD and AdamW are element-wise, so stepping a flat shard a cache-sized chunk at a time
    gives the same bits as one call; one call on a whole 30 MB unit allocated each of its
    temporaries (AdamW's denominator) fresh and page-faulted them every step."""
    names = list(state)
    parts = [t.split(NORM_CHUNK) for t in (master, grad, *state.values())]
    for m, g, *st in zip(*parts):
        optim.step_(m, g, dict(zip(names, st)), spec, step)


def drop_prefetches(z) -> None:
    """Wait out stage-3 gathers that were started but never used, and release units gathered
    but not in use (a prefetch over one shard completes at once; a backward prefetch can land
    after the unit's reduction): after the step they would hand out the values from before it.
    Over one shard the next forward used them: stage 3 then trained on stale parameters (a
    model with a parameter of its own beside a child module's, bf16 at world size 1, ended 42
    away from stage 2)."""
    for u in z.units:
        if u.gathering is not None:
            with z.clock.span("comm_waited"):
                u.gathering.work.wait()
            buf = u.gathering.args[1]
            z.count_live(-buf.numel() * buf.element_size())
            u.gathering = None
        if z.stage == 3 and u.full is not None:
            z.release(u)  # (nothing for resident units)


def _lamb_apply(z, lamb: list) -> None:
    """Trust ratio per original parameter from the partial norms of every rank's shard."""
    norms = []
    for u, r in lamb:
        sq = torch.zeros(len(u.params), 2, dtype=torch.float64)
        for k, a, b, _ in pieces(u.layout, *u.own):
            sq[k, 0] = u.master[a:b].double().square().sum()
            sq[k, 1] = r[a:b].double().square().sum()
        norms.append(sq)
    flat = torch.cat(norms) if norms else torch.zeros(0, 2, dtype=torch.float64)
    if z.stage > 0:
        with z.clock.span("comm_waited"):
            dist.all_reduce(flat, ReduceOp.SUM, z.sgroup)
    row = 0
    for (u, r), sq in zip(lamb, norms):
        part = flat[row:row + len(sq)].sqrt()
        row += len(sq)
        for k, a, b, _ in pieces(u.layout, *u.own):
            trust = optim.trust_ratio(float(part[k, 0]), float(part[k, 1]))
            optim.lamb_apply_(u.master[a:b], r[a:b], trust, z.spec)


def publish(z) -> None:
    """Make the new values visible to the model (stages 0-2; stage 3 gathers on use)."""
    if z.stage == 3:
        drop_prefetches(z)  # a load: no unit keeps the values from before it
        for u in z.units:
            u.fresh = False  # the next gather reads the new primary shards
        return
    if z.stage == 0 or z.shards == 1:  # every rank steps the whole unit: nothing to gather
        if z.dtype != torch.float32:  # (in fp32 the master values are the model's)
            for u in z.units:
                u.full.copy_(u.master)
        return
    z.wait()  # nothing may be queued on the groups before these gathers
    works = [dist.all_gather_into_tensor(u.full, u.master.to(z.dtype, copy=True), z.sgroup, async_op=True)
             for u in z.units]
    with z.clock.span("comm_waited"):
        for work in works:
            work.wait()


def full_master(z, u) -> torch.Tensor:
    """The whole unit's fp32 values (a collective for stages 1-3)."""
    if z.stage == 0:
        return u.master.clone()
    z.fence()  # the comm stream has issued its collectives on these groups
    out = torch.empty(u.layout.padded)
    dist.all_gather_into_tensor(out, u.master.clone(), z.sgroup)
    return out
