"""Quantized all_gather / reduce_scatter / all_reduce against an fp64 reference, within the
bound the codec guarantees (stated per collective below); any world size, any backend.

COMMRT_QUANT_TEST_BROKEN=1 swaps in a codec that truncates instead of rounding: the run must
then fail with "exceeds its bound", which shows the checks can fail.
"""
from __future__ import annotations

import os

import numpy as np
import torch

import commrt
import commrt.quant as cq
from commrt.quant.codecs import Codec
from tests.multirank.programs.common import init

SIZES = [0, 1, 7, 1003, 70001]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
QMAX = {"int8": 127, "int4": 7}
CFG = {"block": 256, "rounding": "nearest", "scale_dtype": "fp32"}  # from [quant] once initialized


def data(numel: int, rank: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Normal values with a few outliers and an all-zero stretch: blocks of very different scales."""
    rng = np.random.default_rng(seed * 100 + rank)
    x = rng.standard_normal(numel)
    if numel > 10:
        x[rng.integers(0, numel, size=numel // 100 + 1)] *= 300.0
        x[numel // 3:numel // 3 + 300] = 0.0
    return torch.from_numpy(x).to(dtype)


def half_scales(x: np.ndarray, bounds, quant: str) -> np.ndarray:
    """Per element: half the scale of its block (absmax / qmax), blocks starting at each
    segment's start; computed here in fp64, independently of the codec. Stochastic rounding:
    a whole scale."""
    block = CFG["block"]
    out = np.zeros(x.size)
    for a, b in bounds:
        for s in range(a, b, block):
            e = min(b, s + block)
            out[s:e] = np.abs(x[s:e]).max() / QMAX[quant] / 2
    fp16 = CFG["scale_dtype"] == "fp16"
    out = out * (1 + (2.0 ** -9 if fp16 else 2.0 ** -20)) + (2.0 ** -25 if fp16 else 0.0)  # scale rounded up
    return out * (2 if CFG["rounding"] == "stochastic" else 1)


def shards(numel: int, n: int):
    base, extra = divmod(numel, n)
    starts = [r * base + min(r, extra) for r in range(n + 1)]
    return list(zip(starts[:-1], starts[1:]))


def check(got: torch.Tensor, want: np.ndarray, bound: np.ndarray, what: str) -> None:
    g = got.double().reshape(-1).numpy()
    slack = np.maximum(np.abs(want), np.abs(g)) * float(torch.finfo(got.dtype).eps) + 1e-30  # output rounding
    err = np.abs(g - want)
    over = err > bound + slack
    if over.any():
        i = int(np.flatnonzero(over)[0])
        raise AssertionError(f"{what}: element {i} error {err[i]:.4g} exceeds its bound {bound[i] + slack[i]:.4g} "
                             f"(got {g[i]}, want {want[i]})")


def same_everywhere(t: torch.Tensor, n: int, what: str) -> None:
    if t.numel() == 0:
        return
    mine = t.reshape(-1).contiguous().view(torch.uint8)
    every = torch.empty(n * mine.numel(), dtype=torch.uint8)
    commrt.all_gather_into_tensor(every, mine)
    for r, part in enumerate(every.chunk(n)):
        if not torch.equal(part, mine):
            raise AssertionError(f"{what}: rank {r}'s result differs from mine bit for bit")


def check_all_gather(rank, n, quant, dtype, numel, seed):
    parts = [data(numel, r, dtype, seed) for r in range(n)]
    out = torch.full((n * numel,), 7.0, dtype=dtype)
    cq.all_gather_into_tensor(out, parts[rank], quant=quant)
    want = torch.cat(parts).double().numpy()
    bound = np.concatenate([half_scales(p.double().numpy(), [(0, numel)], quant) for p in parts])
    check(out, want, bound, f"all_gather {quant} {dtype} n={numel}")  # bound: s_r / 2
    same_everywhere(out, n, f"all_gather {quant} {dtype} n={numel}")


def sum_bound(parts64, bounds, quant, numel):
    """SUM over ranks of s_r / 2, plus fp32 rounding of the n-term sum."""
    e = sum(half_scales(p, bounds, quant) for p in parts64)
    return e + len(parts64) * 2.0 ** -23 * sum(np.abs(p) for p in parts64) if numel else e


def check_reduce_scatter(rank, n, quant, dtype, m, op, seed):
    parts = [data(n * m, r, dtype, seed) for r in range(n)]
    out = torch.full((m,), 7.0, dtype=dtype)
    cq.reduce_scatter_tensor(out, parts[rank], op=op, quant=quant)
    p64 = [p.double().numpy() for p in parts]
    div = n if op == "AVG" else 1
    mine = slice(rank * m, (rank + 1) * m)
    want = sum(p64)[mine] / div
    bound = sum_bound(p64, [(r * m, (r + 1) * m) for r in range(n)], quant, m)[mine] / div
    check(out, want, bound, f"reduce_scatter {op} {quant} {dtype} m={m}")  # bound: sum_r s_r/2 (/n)


def check_all_reduce(rank, n, quant, dtype, numel, op, seed):
    parts = [data(numel, r, dtype, seed) for r in range(n)]
    t = parts[rank].clone()
    cq.all_reduce(t, op=op, quant=quant)
    p64 = [p.double().numpy() for p in parts]
    div = n if op == "AVG" else 1
    want = sum(p64) / div if numel else np.zeros(0)
    b = shards(numel, n)
    e1 = sum_bound(p64, b, quant, numel) / div
    # the reduced shard is quantized again: its block's absmax is at most |want| + e1 there
    e2 = half_scales(np.abs(want) + e1, b, quant) if numel else e1
    check(t, want, e1 + e2, f"all_reduce {op} {quant} {dtype} n={numel}")  # bound: e1 + s'/2
    same_everywhere(t, n, f"all_reduce {op} {quant} {dtype} n={numel}")


def _sent() -> int:
    """Bytes this rank's transport has sent (inside and across nodes), since init."""
    s = commrt.comm_stats()
    return s["intra_node_bytes"] + s["inter_node_bytes"]


def check_wire_bytes(n: int) -> None:
    """Bytes sent per element against fp32 (scales included): the quantized layer's own count,
    and the transport's count of what the quantized all_reduce sent against what the exact one
    sent for the same tensor (on zmq: gloo and nccl count their own bytes, not our transport)."""
    ours = commrt.get_backend() == "zmq"
    t = data(1 << 20, 0, torch.float32, 1)
    before = _sent()
    commrt.all_reduce(t.clone())
    exact = _sent() - before
    for quant, limit in (("int8", 0.26), ("int4", 0.135)):
        cq.STATS.reset()
        before = _sent()
        cq.all_reduce(t, quant=quant)
        sent = _sent() - before
        s = commrt.comm_stats()["quant"]["all_reduce"]
        ratio = s["wire_bytes"] / s["exact_bytes"] if s["exact_bytes"] else 0.0
        assert s["calls"] == 1 and (n == 1 or ratio <= limit), (quant, s)
        if ours and n > 1:  # counted by the transport
            assert 0 < sent <= limit * exact, (quant, sent, exact)
            print(f"transport bytes {quant}: {sent / exact:.4f} x the exact all_reduce's at n={n}", flush=True)
        assert 0 < s["max_abs_error"] <= s["max_error_bound"], s
        print(f"wire bytes {quant}: {ratio:.4f} x fp32 at n={n} ({s})", flush=True)


def check_bad_input(n: int) -> None:
    for call, msg in ((lambda: cq.all_reduce(torch.ones(4), op="MAX"), "supports op ['SUM', 'AVG']"),
                      (lambda: cq.all_reduce(torch.ones(4), quant="int3"), "valid: ['int8', 'int4']"),
                      (lambda: cq.reduce_scatter_tensor(torch.ones(3), torch.ones(3 * n + 1)), "expected"),
                      (lambda: cq.all_gather_into_tensor(torch.ones(3 * n), torch.ones(4)), "expected")):
        try:
            call()
        except ValueError as exc:
            assert msg in str(exc), (msg, str(exc))
        else:
            raise AssertionError(f"no ValueError for {msg}")


def check_non_finite_fails_everywhere(rank: int, n: int, device: torch.device = torch.device("cpu")) -> None:
    """One rank's NaN: every rank raises after the exchange (none waits for it), naming the
    element on the rank that has it, and the tensor keeps its values."""
    t = torch.arange(1003, dtype=torch.float32, device=device)
    if rank == n - 1:
        t[700] = float("nan")
    before = t.clone()
    try:
        cq.all_reduce(t, quant="int4")
    except ValueError as exc:
        want = "element 700 is nan" if rank == n - 1 else "cannot be quantized"
        assert want in str(exc) and "nothing was written" in str(exc), str(exc)
    else:
        raise AssertionError("a NaN input went through a quantized all_reduce")
    assert torch.allclose(t, before, rtol=0, atol=0, equal_nan=True), "the failed all_reduce wrote"


def check_feedback_converges(rank: int, n: int) -> None:
    """The same inputs every step: without feedback the int4 all_reduce repeats its error; with
    it the mean of the results approaches the exact mean (error ~ 1/steps; here 9-14x smaller)."""
    parts = [data(1003, r, torch.float32, 99) for r in range(n)]
    want = sum(p.double() for p in parts).numpy() / n
    errors = {}
    for name, fb in (("plain", None), ("feedback", cq.ErrorFeedback(err_beta=0.8, reset_T=0))):
        total = np.zeros(1003)
        for _ in range(100):
            t = parts[rank].clone()
            cq.all_reduce(t, op="AVG", quant="int4", feedback=fb)
            total += t.double().numpy()
        errors[name] = float(np.abs(total / 100 - want).max())
    # stochastic rounding is unbiased already (its mean error shrinks like 1/sqrt(steps)):
    # feedback still wins, by less
    assert errors["feedback"] < errors["plain"] / (6 if CFG["rounding"] == "nearest" else 2), errors
    print(f"mean error after 100 steps: {errors}", flush=True)


def check_two_hop(rank: int, n: int) -> None:
    """hierarchical_all_reduce on 2 "nodes" x 2 ranks (sub-groups on one host: the algorithm,
    not the link). Bound: each of the four quantizations adds half a scale of its block, the
    block's absmax taken from the exact value plus the error bound so far."""
    if n != 4:
        return
    intra = [commrt.new_group([0, 1]), commrt.new_group([2, 3])][rank // 2]
    inter = [commrt.new_group([0, 2]), commrt.new_group([1, 3])][rank % 2]
    for quant in ("int8", "int4"):
        for numel, op in ((1, "SUM"), (1003, "SUM"), (70001, "AVG")):
            parts = [data(numel, r, torch.float32, 7) for r in range(n)]
            t = parts[rank].clone()
            cq.hierarchical_all_reduce(t, op=op, intra_group=intra, inter_group=inter, quant=quant)
            p64 = [p.double().numpy() for p in parts]
            node_b = shards(numel, 2)
            sub_b = [(a + c, a + d) for a, b in node_b for c, d in shards(b - a, 2)]
            nodes = [p64[0] + p64[1], p64[2] + p64[3]]
            e_a = [half_scales(p64[2 * k], node_b, quant) + half_scales(p64[2 * k + 1], node_b, quant)
                   for k in range(2)]
            e_b = sum(half_scales(np.abs(nodes[k]) + e_a[k], sub_b, quant) for k in range(2))
            e = e_a[0] + e_a[1] + e_b
            e += half_scales(np.abs(sum(p64)) + e, sub_b, quant)
            e += half_scales(np.abs(sum(p64)) + e, node_b, quant)
            div = n if op == "AVG" else 1
            check(t, sum(p64) / div, e / div + 1e-6 * np.abs(sum(p64)), f"two-hop {op} {quant} n={numel}")
            same_everywhere(t, n, f"two-hop {op} {quant} n={numel}")
    print("two-hop all_reduce within bound", flush=True)


def check_shapes(rank: int, n: int) -> None:
    """2-D and non-contiguous tensors: results land in the caller's tensor, shape kept."""
    full = [data(6 * 1003, r, torch.float32, 5).view(6, 1003) for r in range(n)]
    base = full[rank].clone()
    view = base[:, ::2]  # not contiguous
    cq.all_reduce(view, op="AVG", quant="int8")
    want = sum(f[:, ::2].double() for f in full) / n
    # whole-tensor absmaxes bound every block's: a loose but sufficient bound here
    tol = (sum(f.abs().max().item() for f in full) / n + want.abs().max().item()) / 127
    assert view.shape == (6, 502) and torch.equal(base[:, 1::2], full[rank][:, 1::2]), "wrote outside the view"
    assert (view.double() - want).abs().max() <= tol, "result did not land in the view"
    out = torch.zeros(n, 4, 3).transpose(1, 2)  # non-contiguous output
    cq.all_gather_into_tensor(out, torch.full((3, 4), float(rank)), quant="int4")
    for r in range(n):
        # the codec's bound for a constant block: half a scale (a whole one when rounding is stochastic)
        bound = half_scales(np.full(12, float(r)), [(0, 12)], "int4").max()
        assert (out[r].double() - r).abs().max() <= bound, (r, bound, out)


def main() -> None:
    rank, n = init()
    q = commrt.get_config().quant
    CFG.update(block=q.block, rounding=q.rounding, scale_dtype=q.scale_dtype)
    if os.environ.get("COMMRT_QUANT_TEST_BROKEN") == "1":
        Codec._round = lambda self, v, rng: np.trunc(v, out=v)
    seed = 0
    for quant in ("int8", "int4"):
        for dtype in DTYPES:
            for numel in SIZES:
                seed += 1
                check_all_gather(rank, n, quant, dtype, numel, seed)
                for op in ("SUM", "AVG"):
                    check_all_reduce(rank, n, quant, dtype, numel, op, seed)
                    check_reduce_scatter(rank, n, quant, dtype, numel // n + (numel % 3), op, seed)
    check_bad_input(n)
    check_non_finite_fails_everywhere(rank, n)
    check_shapes(rank, n)
    check_feedback_converges(rank, n)
    check_two_hop(rank, n)
    check_wire_bytes(n)
    commrt.barrier()
    commrt.destroy_process_group()
    print(f"rank {rank}: quant passed on {n} ranks", flush=True)


if __name__ == "__main__":
    main()
