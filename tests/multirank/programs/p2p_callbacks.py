"""A Work's done-callback that posts point-to-point operations, on numpy buffers. Two ranks.

    p2p_callbacks chain   rank 0 sends large messages (zero-copy over TCP: the engine thread
                          finishes them) whose done-callback each sends a small one, while its
                          main thread keeps posting small sends; rank 1 receives everything and
                          checks it. A callback run under the engine's lock deadlocked here
                          against the main thread's isend (which holds the group's p2p lock and
                          waits for the engine's).
Rank 0 prints "chain passed" when every send and every callback's send has completed."""
from __future__ import annotations

import itertools
import sys
import time

import numpy as np

import commrt

N, SMALL_PER_LARGE = 20, 50
LARGE = (2 << 20) // 4  # float32 elements: 2 MiB, over ZERO_COPY_MIN_BYTES (transport/endpoint.py)


def chain(rank: int) -> None:
    if rank == 0:
        sent, number = [], itertools.count()  # the callbacks' sends, from whichever thread ran them

        def forward(work) -> None:
            sent.append(commrt.isend(np.full(4, float(next(number)), np.float32), 1, tag=1))
        works = []
        big = np.ones(LARGE, np.float32)
        for _ in range(N):
            w = commrt.isend(big, 1, tag=0)
            w.add_done_callback(forward)
            works.append(w)
            works += [commrt.isend(np.full(4, 2.0, np.float32), 1, tag=2) for _ in range(SMALL_PER_LARGE)]
        for w in works:
            w.wait()
        end = time.monotonic() + 30
        while len(sent) < N and time.monotonic() < end:
            time.sleep(0.01)
        assert len(sent) == N, f"{len(sent)} of {N} callbacks ran"
        for w in sent:
            w.wait()
        print("chain passed", flush=True)
        return
    large = [np.zeros(LARGE, np.float32) for _ in range(N)]
    forwarded = [np.zeros(4, np.float32) for _ in range(N)]
    small = [np.zeros(4, np.float32) for _ in range(N * SMALL_PER_LARGE)]
    works = [commrt.irecv(b, 0, tag=0) for b in large] + [commrt.irecv(b, 0, tag=1) for b in forwarded]
    works += [commrt.irecv(b, 0, tag=2) for b in small]
    for w in works:
        w.wait()
    assert all(np.all(b == 1.0) for b in large) and all(np.all(b == 2.0) for b in small)
    assert sorted(float(b[0]) for b in forwarded) == [float(i) for i in range(N)]


def main() -> None:
    mode = sys.argv[1]
    commrt.init_process_group()
    try:
        {"chain": chain}[mode](commrt.get_rank())
    finally:
        commrt.destroy_process_group()


if __name__ == "__main__":
    main()
