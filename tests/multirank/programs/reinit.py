"""init, all_reduce, destroy, then init again on the same MASTER_PORT in a chosen order:

    reinit MARKER_DIR together|rank0_first|others_first

rank0_first: rank 0 re-initialises (a new store on the port) before the others have left;
others_first: the others re-initialise while rank 0 still serves the previous store.
The sleeps only bias the order (markers say when a side is about to act); the results are
checked whatever order actually happened."""
from __future__ import annotations

import os
import sys
import time

import numpy as np

import commrt

RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def mark(directory: str, name: str) -> None:
    open(os.path.join(directory, name), "w").close()


def wait_marks(directory: str, names: list[str], within_s: float = 60.0) -> None:
    deadline = time.monotonic() + within_s
    while not all(os.path.exists(os.path.join(directory, n)) for n in names):
        if time.monotonic() > deadline:
            raise TimeoutError(f"markers {names} never appeared")
        time.sleep(0.02)


def check(round_: int) -> None:
    t = np.full(1000, float(RANK + 1 + round_), np.float32)
    commrt.all_reduce(t)
    want = sum(r + 1 + round_ for r in range(WORLD))
    assert np.array_equal(t, np.full(1000, float(want), np.float32)), (round_, t[:3])


def main() -> None:
    directory, order = sys.argv[1], sys.argv[2]
    commrt.init_process_group(timeout=30)
    check(0)
    others = [f"left{r}" for r in range(1, WORLD)]
    if order == "others_first":
        if RANK == 0:
            wait_marks(directory, others)
            time.sleep(1.0)  # the others are dialling the port while our old store still answers
        commrt.destroy_process_group()
        if RANK != 0:
            mark(directory, f"left{RANK}")
    elif order == "rank0_first":
        if RANK != 0:
            wait_marks(directory, ["left0"])
            time.sleep(0.5)  # rank 0 is serving its new store by now, probably
        commrt.destroy_process_group()
        if RANK == 0:
            mark(directory, "left0")
    else:
        commrt.destroy_process_group()
    commrt.init_process_group(timeout=30)
    check(1)
    commrt.destroy_process_group()
    print(f"rank {RANK}: reinit {order} passed", flush=True)


if __name__ == "__main__":
    main()
