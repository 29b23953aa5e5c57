"""bool tensors and numpy bool arrays through every collective, against a single-process
reference: SUM and MAX are a logical or, PRODUCT and MIN a logical and (as torch, gloo and NCCL
define them; never wrapping, at any number of ranks); AVG of bools is a ValueError naming the op
and the dtype on every rank, and the group goes on. bool used to be refused by every op
("dtype torch.bool is not supported").

    bool_ops
"""
from __future__ import annotations

import numpy as np
import torch

import commrt

SIZES = [0, 7, 70001]  # 70001: past the small-message threshold (ring, shm rounds)
LOGICAL = {"SUM": np.logical_or, "MAX": np.logical_or, "PRODUCT": np.logical_and, "MIN": np.logical_and}


def truths(numel: int, rank: int, seed: int) -> np.ndarray:
    """Mostly True (so that an and of 3 ranks is not all False), some False."""
    return np.random.default_rng(seed * 100 + rank).random(numel) < 0.7


def mine(a: np.ndarray, kind: str):
    return torch.from_numpy(a.copy()) if kind == "torch" else a.copy()


def check(got, want: np.ndarray, what: str) -> None:
    got = got.numpy() if isinstance(got, torch.Tensor) else got
    assert got.dtype == np.bool_ and np.array_equal(got, want), f"{what}: got {got[:8]} want {want[:8]}"


def reductions(rank: int, n: int, kind: str, seed: int) -> int:
    for op, fold in LOGICAL.items():
        for numel in SIZES:
            seed += 1
            what = f"{kind} {op} numel={numel}"
            parts = [truths(numel, r, seed) for r in range(n)]
            want = fold.reduce(parts) if n > 1 else parts[0]
            t = mine(parts[rank], kind)
            commrt.all_reduce(t, op=op)
            check(t, want, f"all_reduce {what}")
            t = mine(parts[rank], kind)
            commrt.reduce(t, dst=seed % n, op=op)
            check(t, want if rank == seed % n else parts[rank], f"reduce {what}")
            full = [truths(numel * n, r, seed) for r in range(n)]
            out = mine(np.zeros(numel, bool), kind)
            commrt.reduce_scatter_tensor(out, mine(full[rank], kind), op=op)
            check(out, (fold.reduce(full) if n > 1 else full[0])[rank * numel:(rank + 1) * numel],
                  f"reduce_scatter {what}")
    return seed


def movement(rank: int, n: int, kind: str, seed: int) -> int:
    for numel in SIZES:
        seed += 1
        parts = [truths(numel, r, seed) for r in range(n)]
        out = mine(np.zeros(numel * n, bool), kind)
        commrt.all_gather_into_tensor(out, mine(parts[rank], kind))
        check(out, np.concatenate(parts), f"all_gather {kind} numel={numel}")
        t = mine(parts[rank], kind)
        commrt.broadcast(t, src=seed % n)
        check(t, parts[seed % n], f"broadcast {kind} numel={numel}")
        inp = mine(truths(numel * n, rank, seed), kind)
        out = mine(np.zeros(numel * n, bool), kind)
        commrt.all_to_all_single(out, inp)
        want = np.concatenate([truths(numel * n, r, seed)[rank * numel:(rank + 1) * numel] for r in range(n)])
        check(out, want, f"all_to_all {kind} numel={numel}")
    return seed


def avg_is_refused(rank: int, n: int, kind: str) -> None:
    t = mine(np.ones(4 * n, bool), kind)
    calls = {"all_reduce": lambda: commrt.all_reduce(t, op="avg"),
             "reduce": lambda: commrt.reduce(t, dst=0, op="avg"),
             "reduce_scatter": lambda: commrt.reduce_scatter_tensor(t[:4], t, op="avg")}
    for name, call in calls.items():
        try:
            call()
        except ValueError as exc:
            assert "AVG" in str(exc) and "bool" in str(exc), exc
        else:
            raise AssertionError(f"{kind} {name} AVG of bools did not raise")
        check(t, np.ones(4 * n, bool), f"{kind} {name} AVG refused: buffer unchanged")
    t = mine(np.array([rank == 0, False, True]), kind)
    commrt.all_reduce(t, op="max")  # the group goes on
    check(t, np.array([True, False, True]), f"{kind} after the refusals")


def checks() -> None:
    """Every check, on the initialized world (programs/dtype_ops.py runs it beside the others)."""
    rank, n = commrt.get_rank(), commrt.get_world_size()
    seed = 0
    for kind in ("torch", "numpy"):
        seed = reductions(rank, n, kind, seed)
        seed = movement(rank, n, kind, seed)
        avg_is_refused(rank, n, kind)
    if n > 1:  # point to point too
        if rank == 0:
            commrt.send(torch.tensor([True, False, True]), dst=1)
        elif rank == 1:
            got = torch.zeros(3, dtype=torch.bool)
            commrt.recv(got, src=0)
            check(got, np.array([True, False, True]), "recv")
    commrt.barrier()
    print(f"rank {rank}: bool ops passed", flush=True)


def main() -> None:
    commrt.init_process_group()
    checks()
    commrt.destroy_process_group()


if __name__ == "__main__":
    main()
