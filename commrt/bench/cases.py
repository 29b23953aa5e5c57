"""One (collective, size) on one rank for ``commrt bench``: its buffers, the closures that run,
reset and refill it, and the single-process reference its result is checked against."""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
import torch

from commrt.bench import metrics
from commrt.collectives.reduce_ops import ReduceOp


def pattern(numel: int, rank: int, dtype: torch.dtype, op: ReduceOp) -> torch.Tensor:
    """Small integers (|v| <= 8), so that sums and products are exact in every dtype we support,
    and different for every rank: a piece of another rank's data in the wrong place is caught.

    Element i is a Reed-Solomon symbol: the polynomial whose coefficients are the rank's digits in
    base p (a prime), evaluated at i mod p, over GF(p). Two ranks' polynomials of fewer than D
    digits agree on at most D - 1 points, so any D consecutive elements tell every two ranks
    below p**D apart (D = 4 for 16,384 ranks), and one element tells those below p. p = 17 (values
    -8..8); for uint8, 7 (values 0..6: its sums wrap no sooner than before). The pattern used
    to be ``(7i + 13 rank) % 17 - 8``, the same for ranks 17 apart; for ranks below 17 it still is.
    PRODUCT keeps its 1s and 2s (a 2 wherever (i + rank) % 3 == 0): more distinct values would
    overflow sooner; it repeats every 3 ranks."""
    i = torch.arange(numel, dtype=torch.int64)
    if op == ReduceOp.PRODUCT:
        return (1 + ((i + rank) % 3 == 0).long()).to(dtype)
    p, a, b, low = (7, 3, 5, 0) if dtype == torch.uint8 else (17, 7, 13, -8)
    x, poly = i % p, torch.zeros(numel, dtype=torch.int64)
    for digit in reversed(_digits(rank, p)):  # Horner
        poly = (poly * x + digit) % p
    return ((a * i + b * poly) % p + low).to(dtype)


def _digits(rank: int, base: int) -> list[int]:
    """``rank``'s digits in ``base``, least significant first ([0] for rank 0)."""
    out = [rank % base]
    while rank >= base:
        rank //= base
        out.append(rank % base)
    return out


def reference(parts: list[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    """Single-process reduction of every rank's tensor, in rank order (the oracle)."""
    wide = [p.double() if p.is_floating_point() else p.long() for p in parts]
    acc = wide[0].clone()
    for p in wide[1:]:
        if op in (ReduceOp.SUM, ReduceOp.AVG):
            acc += p
        elif op == ReduceOp.PRODUCT:
            acc *= p
        elif op == ReduceOp.MAX:
            acc = torch.maximum(acc, p)
        else:
            acc = torch.minimum(acc, p)
    if op == ReduceOp.AVG:
        acc = acc / len(parts) if acc.is_floating_point() else torch.div(acc, len(parts), rounding_mode="floor")
    return acc.to(parts[0].dtype)


@dataclasses.dataclass
class Case:
    """Buffers and closures for one (collective, size) on one rank."""
    run: Callable[[], None]
    reset: Callable[[], None]
    check: Callable[[], torch.Tensor]  # the tensor to compare
    expected: torch.Tensor
    count: int
    nbytes: int
    refill: Callable[[], None] = lambda: None  # rewrite the input, as a new step's gradients


def _resetter(out: torch.Tensor, expected: torch.Tensor, refill: Callable[[], None]) -> Callable[[], None]:
    """Before the checked run of an out-of-place op: its input rewritten and its output set to
    values the result cannot hold (NaN; for integers the expected value + 1), so the check sees
    what that run wrote. The output used to keep the earlier runs' result: an op that then
    wrote nothing, or only part of it, passed."""
    poison = (torch.full_like(expected, float("nan")) if expected.is_floating_point() else expected + 1).to(out.device)

    def reset() -> None:
        refill()
        out.copy_(poison.reshape(out.shape))
    return reset


def _refiller(dst: torch.Tensor, src: torch.Tensor, as_numpy: bool) -> Callable[[], None]:
    """dst[:] = src, the way the program would write it: numpy for numpy input (one thread),
    torch's copy for tensors (which may use its intra-op threads, as a training step does)."""
    if as_numpy:
        d, s = dst.numpy(), src.numpy()
        return lambda: np.copyto(d, s)
    return lambda: dst.copy_(src)


_DEVICE = {"all": "cpu"}
"""``BenchSpec.device`` of this rank's run (set once by ``run``: one spec a process), so the
helpers below that take only a backend know it."""


def device_of(be) -> torch.device:
    """Where a backend's tensors live: NCCL works on this rank's GPU; the others on the CPU, or
    on the GPU too with ``--device cuda`` (zmq / gloo then stage them through host memory)."""
    if be.name.split("+")[0] == "nccl" or _DEVICE["all"] == "cuda":  # nccl+hier, nccl+int8 too
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def element_count(coll: str, n: int, nbytes: int, itemsize: int) -> int:
    """Elements a case of ``nbytes`` holds: whole elements, at least one, and for the collectives
    that cut the buffer in ``n`` parts a multiple of ``n``."""
    count = max(1, nbytes // itemsize)
    if coll in ("reduce_scatter", "all_gather", "all_to_all"):
        count = max(n, count // n * n)
    return count


def distinct_sizes(coll: str, n: int, sizes: list[int], itemsize: int) -> list[int]:
    """The sizes whose cases differ: -b 4 -e 16 of an all_to_all over 3 ranks made three rows of
    the same 12 B case (each size rounded to whole elements, a multiple of n)."""
    out, seen = [], set()
    for s in sizes:
        count = element_count(coll, n, s, itemsize)
        if count not in seen:
            seen.add(count)
            out.append(s)
    return out


def make_case(coll: str, be, nbytes: int, dtype: torch.dtype, op: ReduceOp, as_numpy: bool = False) -> Case:
    """``as_numpy``: the collective gets numpy views of the buffers (the public API takes both)."""
    n, r = be.size, be.rank
    item = dtype.itemsize
    count = element_count(coll, n, nbytes, item)
    m = count // n
    dev = device_of(be)
    if as_numpy and (dev.type != "cpu" or dtype == torch.bfloat16):
        raise ValueError(f"--input numpy needs a CPU backend and a numpy dtype, not {be.name} / {dtype}")
    arg = (lambda t: t.numpy()) if as_numpy else (lambda t: t)
    cpu_pats = [pattern(count, k, dtype, op) for k in range(n)]
    pats = [p.to(dev) for p in cpu_pats]
    mine = pats[r].clone()  # the input the op reads; pats[r] stays the source of each refill
    refill = _refiller(mine, pats[r], as_numpy)
    size = count * item
    if coll in ("all_reduce", "broadcast", "reduce"):
        exp = {"all_reduce": reference(cpu_pats, op), "broadcast": cpu_pats[0],
               "reduce": reference(cpu_pats, op) if r == 0 else cpu_pats[r]}[coll]
        x = arg(mine)
        run = {"all_reduce": lambda: be.all_reduce(x, op, False), "broadcast": lambda: be.broadcast(x, 0, False),
               "reduce": lambda: be.reduce(x, 0, op, False)}[coll]
        return Case(run, refill, lambda: mine, exp, count, size, refill)
    if coll == "sendrecv":
        return _sendrecv_case(be, pats, cpu_pats, mine, refill, arg, count, size)
    out = torch.empty(m if coll == "reduce_scatter" else count, dtype=dtype, device=dev)
    o, x = arg(out), arg(mine)
    if coll == "reduce_scatter":
        exp = reference(cpu_pats, op)[r * m:(r + 1) * m]
        return Case(lambda: be.reduce_scatter_tensor(o, x, op, False), _resetter(out, exp, refill), lambda: out,
                    exp, count, size, refill)
    if coll == "all_gather":
        part = mine[:m]
        p, exp, refill = arg(part), torch.cat([q[:m] for q in cpu_pats]), _refiller(part, pats[r][:m], as_numpy)
        return Case(lambda: be.all_gather_into_tensor(o, p, False), _resetter(out, exp, refill), lambda: out,
                    exp, count, size, refill)
    if coll == "all_to_all":
        exp = torch.cat([cpu_pats[k][r * m:(r + 1) * m] for k in range(n)])
        return Case(lambda: be.all_to_all_single(o, x, None, None, False), _resetter(out, exp, refill),
                    lambda: out, exp, count, size, refill)
    raise ValueError(f"unknown collective '{coll}'; valid: {list(metrics.COLLECTIVES)}")


def _sendrecv_case(be, pats, cpu_pats, mine, refill, arg, count: int, size: int) -> Case:
    n, r = be.size, be.rank
    out = torch.empty_like(mine)
    right, left = (r + 1) % n, (r - 1) % n
    x, o = arg(mine), arg(out)

    def run():
        if n == 1:
            out.copy_(mine)
            return
        works = [be.isend(x, right, 0), be.irecv(o, left, 0)]
        for w in works:
            w.wait()
    return Case(run, _resetter(out, cpu_pats[left], refill), lambda: out, cpu_pats[left], count, size, refill)
