"""One rank refuses an op on bad input that only it has (a read-only output, output and input
dtypes that differ): it raises its own error, and its peers, waiting in the op, fail within a few
seconds with an OpRefused naming it and the op, not at the deadline (COMMRT_COMM_TIMEOUT_S = 60).
Rank 1 is the one that refuses, then waits (without any op) until every peer has written its
file in <dir>, as a rank busy elsewhere would: the peers cannot count on its next op to break
the wait. The peers had started the op, so the group is unusable: every rank's next op fails at
once, naming the refusal. Every rank prints 'refusals <case> ok'.

    refusals <case> <dir>
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

import commrt
from commrt.runtime.errors import CommError, OpRefused

BOUND_S = 20  # far below the 60 s deadline: the peers must not wait it out


def read_only(a: np.ndarray) -> np.ndarray:
    return np.frombuffer(a.tobytes(), a.dtype)


def readonly_output(rank: int, n: int) -> tuple[str, type]:
    t = np.ones(8, np.float32)
    commrt.all_reduce(read_only(t) if rank == 1 else t)
    return "all_reduce", ValueError


def dtypes_differ(rank: int, n: int) -> tuple[str, type]:
    out = np.zeros(4 * n, np.float64 if rank == 1 else np.float32)
    commrt.all_gather_into_tensor(out, np.ones(4, np.float32))
    return "all_gather", TypeError


def broadcast_leaf(rank: int, n: int) -> tuple[str, type]:
    """The root mostly sends, yet it waits too (the root check's hop over TCP, every step on
    shared memory): it must not wait out the deadline either."""
    t = np.arange(8, dtype=np.float32)
    commrt.broadcast(read_only(t) if rank == 1 else t, src=0)
    return "broadcast", ValueError


def async_reduce_scatter(rank: int, n: int) -> tuple[str, type]:
    """Issued async behind another async op: the refusal takes its place in the sequence."""
    first = commrt.all_reduce(np.ones(8, np.float32), async_op=True)
    out = np.zeros(4, np.float32)
    inp = np.ones(4 * n + (1 if rank == 1 else 0), np.float32)  # one element too many on rank 1
    try:
        work = commrt.reduce_scatter_tensor(out, inp, async_op=True)
    finally:
        first.wait()
    work.wait()
    return "reduce_scatter", ValueError


def unknown_root(rank: int, n: int) -> tuple[str, type]:
    """The front door refuses a root outside the group, before the backend sees the op."""
    commrt.reduce(np.ones(8, np.float32), dst=n + 3 if rank == 1 else 0)
    return "reduce", ValueError


CASES = {"unknown_root": unknown_root, "readonly_output": readonly_output, "dtypes_differ": dtypes_differ, "broadcast_leaf": broadcast_leaf,
         "async_reduce_scatter": async_reduce_scatter}


def main() -> None:
    case, marks = sys.argv[1], sys.argv[2]
    commrt.init_process_group()
    rank, n = commrt.get_rank(), commrt.get_world_size()
    commrt.barrier()
    start = time.monotonic()
    try:
        CASES[case](rank, n)
    except OpRefused as exc:
        took = time.monotonic() - start
        assert rank != 1, f"rank {rank} got a peer's error: {exc}"
        assert exc.rank == 1 and exc.reported_by is None and "rank 1 refused" in str(exc), exc
        assert took < BOUND_S, f"the refusal took {took:.1f}s to arrive: {exc}"
        open(os.path.join(marks, f"rank{rank}"), "w").close()
    except (ValueError, TypeError) as exc:
        assert rank == 1 and not isinstance(exc, CommError), f"rank {rank}: {exc!r}"
        while len(os.listdir(marks)) < n - 1:  # the peers heard of it without any op of ours
            assert time.monotonic() - start < BOUND_S, f"the peers did not hear of the refusal: {os.listdir(marks)}"
            time.sleep(0.05)
    else:
        raise AssertionError(f"rank {rank}: {case} did not fail")
    try:
        commrt.barrier()
    except CommError as exc:
        assert time.monotonic() - start < BOUND_S + 10, exc
        assert "refused" in str(exc) and "rank 1" in str(exc), f"rank {rank}: {exc}"
    else:
        raise AssertionError(f"rank {rank}: the barrier after the refusal succeeded")
    commrt.destroy_process_group()
    print(f"refusals {case} ok", flush=True)


if __name__ == "__main__":
    main()
