"""A numpy-only rank at scale (issue 32 items 2, 3, 5): rendezvous, barrier, 4 KiB and 1 MiB
all_reduce checked exactly against the single-process reference, messages per small all_reduce
(comm_stats), what the rank costs (comm_stats()["resources"]), and that torch never loaded.

    lean_rank scale [ITERS]        print one LEAN line per rank
    lean_rank kill VICTIM [ITERS]  the same, then VICTIM is SIGKILLed after a barrier and every
                                   survivor must name it (PeerLost) in that barrier or its next
                                   all_reduce; KILLED and CAUGHT lines carry the host's clock
    lean_rank tensor [ITERS]       the scale run on torch tensors over the same memory (the
                                   torch rank's cost, for comparison)
    lean_rank api                  every public collective and point-to-point on numpy arrays,
                                   checked against the reference; prints API ok

Timings are this rank's wall time per op over ITERS back-to-back ops after a barrier;
``init_s`` is init_process_group's duration (rendezvous, connections, the world barrier),
which includes waiting for the last rank to start.
"""
from __future__ import annotations

import hashlib
import os
import signal
import sys
import time

import numpy as np

import commrt

RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
SMALL, LARGE = 1024, 1 << 18  # float32 elements: 4 KiB and 1 MiB


def part(rank: int, numel: int, i: int) -> np.ndarray:
    """Rank ``rank``'s input of op ``i``: small integers, so every sum is exact in float32."""
    return ((np.arange(numel, dtype=np.int64) * (rank + 1) + i) % 13).astype(np.float32)


def reference(numel: int, i: int) -> np.ndarray:
    """The single-process sum over every rank's input (int64, then float32: exact)."""
    total = np.zeros(numel, np.int64)
    for r in range(WORLD):
        total += part(r, numel, i).astype(np.int64)
    return total.astype(np.float32)


def timed_all_reduces(numel: int, iters: int, wrap) -> float:
    """Seconds per all_reduce of ``numel`` float32 over ``iters`` ops, each result checked."""
    bufs = [part(RANK, numel, i) for i in range(iters)]
    commrt.barrier()
    start = time.perf_counter()
    for b in bufs:
        commrt.all_reduce(wrap(b))
    took = (time.perf_counter() - start) / iters
    for i, b in enumerate(bufs):  # the arrays were updated in place (through a tensor view too)
        assert np.array_equal(b, reference(numel, i)), f"rank {RANK}: op {i} of {numel} elements differs"
    return took


def barrier_s(iters: int) -> float:
    commrt.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        commrt.barrier()
    return (time.perf_counter() - start) / iters


def float_digest(wrap) -> str:
    """A random float sum: close to the reference and, by its digest, bit-identical on every rank."""
    x = np.random.default_rng(RANK).standard_normal(SMALL).astype(np.float32)
    commrt.all_reduce(wrap(x))
    want = sum(np.random.default_rng(r).standard_normal(SMALL).astype(np.float32).astype(np.float64)
               for r in range(WORLD))
    assert np.allclose(x, want, rtol=0, atol=1e-4 * WORLD), float(np.abs(x - want).max())
    return hashlib.sha256(x.tobytes()).hexdigest()[:16]


def scale(iters: int, wrap=lambda a: a) -> None:
    started = time.perf_counter()
    commrt.init_process_group()
    init_s = time.perf_counter() - started
    commrt.all_reduce(wrap(part(RANK, SMALL, 0)))  # connects to the schedule's peers: not timed
    before = commrt.comm_stats()["by_op"]["all_reduce"]["messages"]
    small = timed_all_reduces(SMALL, iters, wrap)
    msgs = (commrt.comm_stats()["by_op"]["all_reduce"]["messages"] - before) / iters
    res = commrt.comm_stats()["resources"]  # after the small all_reduces: their peers only
    bar = barrier_s(iters)
    large = timed_all_reduces(LARGE, max(2, iters // 10), wrap)
    digest = float_digest(wrap)
    peak = commrt.comm_stats()["resources"]
    torch_loaded = "torch" in sys.modules
    print(f"LEAN rank {RANK} world {WORLD} init_s {init_s:.3f} barrier_us {bar * 1e6:.1f} "
          f"ar4k_us {small * 1e6:.1f} ar1m_us {large * 1e6:.1f} msgs {msgs:g} fds {res['open_files']} "
          f"threads {res['threads']} rss_kib {res['rss_kib']} hwm_kib {peak['peak_rss_kib']} "
          f"fds_after_1m {peak['open_files']} torch {int(torch_loaded)} digest {digest}", flush=True)


def kill(victim: int, iters: int) -> None:
    scale(iters)
    started = time.perf_counter()
    try:
        # the victim leaves this barrier and dies at once: what it queued last for a peer may
        # die with it (SIGKILL), and that peer then names it here
        commrt.barrier()
        if RANK == victim:
            print(f"KILLED rank {RANK} at {time.monotonic():.3f}", flush=True)  # the host's monotonic clock
            os.kill(os.getpid(), signal.SIGKILL)
        for i in range(1000):  # the first op that needs the victim (directly or by a partner's notice)
            commrt.all_reduce(part(RANK, SMALL, i))
        print("NOT CAUGHT: 1000 all_reduces completed without the victim", flush=True)
    except commrt.PeerLost as exc:
        # at: the host's monotonic clock, as the victim's KILLED line; told by: the rank whose
        # notice it was (-: this rank saw the victim's connection drop itself)
        by = "-" if exc.reported_by is None else exc.reported_by
        print(f"CAUGHT rank {RANK} PeerLost rank {exc.rank} after {time.perf_counter() - started:.3f}s "
              f"at {time.monotonic():.3f} told by {by}: {exc}", flush=True)


def api() -> None:
    """Each call on numpy arrays (in place, a non-contiguous one too), over whichever path the
    environment picks (shared memory or TCP), against what one process computes."""
    commrt.init_process_group()
    n, nxt, prev = WORLD, (RANK + 1) % WORLD, (RANK - 1) % WORLD
    parts = [part(r, 300, 1) for r in range(n)]
    total = reference(300, 1)
    x = parts[RANK].copy()
    commrt.all_reduce(x)
    assert np.array_equal(x, total), "all_reduce"
    grid = np.zeros((n, 600), np.float32)
    grid[:, ::2] = parts[RANK]  # a strided view: flattened, reduced, written back
    commrt.all_reduce(grid[:, ::2], op=commrt.ReduceOp.MAX)
    assert np.array_equal(grid[:, ::2], np.broadcast_to(np.max(parts, 0), (n, 300))) and not grid[:, 1::2].any()
    b = parts[RANK].copy()
    commrt.broadcast(b, n - 1)
    assert np.array_equal(b, parts[n - 1]), "broadcast"
    gathered = np.zeros(300 * n, np.float32)
    commrt.all_gather_into_tensor(gathered, parts[RANK])
    assert np.array_equal(gathered, np.concatenate(parts)), "all_gather"
    mine = np.zeros(100, np.float32)  # every block of the input is this rank's first 100 values
    commrt.reduce_scatter_tensor(mine, np.tile(parts[RANK][:100], n))
    assert np.array_equal(mine, total[:100]), "reduce_scatter"
    swapped = np.zeros(n, np.int64)
    commrt.all_to_all_single(swapped, np.arange(n, dtype=np.int64) + 10 * RANK)
    assert np.array_equal(swapped, np.arange(n) * 10 + RANK), "all_to_all"
    got = np.zeros(70000, np.float32)  # above the rings' threshold: shared memory between local ranks
    work = commrt.isend(part(RANK, 70000, 2), nxt)
    commrt.recv(got, prev)
    work.wait()
    assert np.array_equal(got, part(prev, 70000, 2)), "send/recv"
    commrt.barrier()
    assert "torch" not in sys.modules, "torch was imported"
    print(f"API ok rank {RANK}", flush=True)


if __name__ == "__main__":
    mode, rest = sys.argv[1], [int(a) for a in sys.argv[2:]]
    if mode == "api":
        api()
    elif mode == "kill":
        kill(rest[0], *(rest[1:] or [20]))
    elif mode == "tensor":
        import torch  # the comparison: the same ops on tensors over the same memory
        scale(*(rest or [20]), wrap=torch.from_numpy)
    else:
        scale(*(rest or [20]))
    if commrt.is_initialized():
        commrt.destroy_process_group()
