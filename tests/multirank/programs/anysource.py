"""Receives from any source (``commrt.recv(t)`` without ``src``), against what every rank sent.

    anysource MODE   with MODE in
      match    every rank but 0 sends K messages with one tag; rank 0 takes them all from any
               source, small (socket) and large (a shared-memory ring where the group has one),
               posted before and after the data arrived; posting order between a receive from
               one peer and one from any is kept (MPI's rule; gloo keeps it one way only)
      silent   rank 0 waits for a tag nobody sends: a PeerLost naming no rank, by the deadline
      dead     the last rank dies while rank 0 waits for a tag from any source: a PeerLost naming
               it, long before the deadline (issue 30 item 11)
Rank 0 prints what it received; the reference is what each sender's rank and index make."""
from __future__ import annotations

import os
import sys
import time

import numpy as np

import commrt

K = 4
SIZES = [1000, 1 << 16]  # 4 KB through the socket; 256 KiB through a ring on a shared-memory group


def payload(src: int, i: int, size: int) -> np.ndarray:
    return np.arange(size, dtype=np.float32) + (src * 1000 + i)


def take_all(n: int, size: int, tag: int) -> None:
    """(n-1)*K receives from any source: each sender's K messages, whole and in its order."""
    seen: dict[int, list[int]] = {p: [] for p in range(1, n)}
    for _ in range((n - 1) * K):
        got = np.full(size, -1.0, np.float32)
        src = commrt.recv(got, tag=tag)
        i = int(got[0]) - src * 1000
        assert np.array_equal(got, payload(src, i, size)), (src, i, got[:4])
        seen[src].append(i)
    assert seen == {p: list(range(K)) for p in range(1, n)}, seen


def match(rank: int, n: int) -> None:
    for size in SIZES:
        # 1. receives posted while the senders send
        if rank == 0:
            take_all(n, size, tag=1)
        else:
            for i in range(K):
                commrt.send(payload(rank, i, size), 0, tag=1)
        # 2. everything sent and kept before a receive is posted
        works = [commrt.isend(payload(rank, i, size), 0, tag=2) for i in range(K)] if rank else []
        commrt.barrier()
        if rank == 0:
            time.sleep(0.2)  # the messages are here
            take_all(n, size, tag=2)
        for w in works:
            w.wait()
        # 3. order between a receive from peer 1 and one from any, both posted before the data
        # comes: the one posted first takes peer 1's first message (gloo keeps this only when
        # the receive from peer 1 is posted first)
        for tag, any_first in ((3, False), (4, True)):
            if any_first and commrt.get_backend() == "gloo":
                continue
            if rank == 1:
                commrt.recv(np.empty(1, np.float32), 0, tag=5)  # rank 0 has posted both
                for i in range(2):
                    commrt.send(payload(1, i, size), 0, tag=tag)
            elif rank == 0:
                first, anyone = np.empty(size, np.float32), np.empty(size, np.float32)
                if any_first:
                    w2 = commrt.irecv(anyone, tag=tag)
                w1 = commrt.irecv(first, 1, tag=tag)
                if not any_first:
                    w2 = commrt.irecv(anyone, tag=tag)
                commrt.send(np.ones(1, np.float32), 1, tag=5)
                w1.wait()
                assert w2.result() == 1
                want = [payload(1, int(any_first), size), payload(1, 1 - int(any_first), size)]
                assert np.array_equal(first, want[0]) and np.array_equal(anyone, want[1]), (tag, first[0], anyone[0])
        commrt.barrier()
    if rank == 0:
        print("anysource match passed", flush=True)


def silent(rank: int, n: int) -> None:
    if rank == 0:
        start = time.monotonic()
        try:
            commrt.recv(np.empty(4, np.float32), tag=99)
        except commrt.PeerLost as exc:
            print(f"CAUGHT PeerLost after {time.monotonic() - start:.1f}s: {exc}", flush=True)
    commrt.barrier()


def dead(rank: int, n: int) -> None:
    commrt.barrier()
    if rank == n - 1:
        os._exit(0)  # gone without a word, a possible sender of rank 0's receive
    if rank == 0:
        start = time.monotonic()
        try:
            commrt.recv(np.empty(4, np.float32), tag=77)
        except commrt.PeerLost as exc:
            print(f"CAUGHT PeerLost rank {exc.rank} after {time.monotonic() - start:.1f}s: {exc}", flush=True)
        commrt.send(np.ones(1, np.float32), 1, tag=5)
        try:  # alive until rank 1 has it: a send is buffered, and exiting at once could lose it
            commrt.recv(np.empty(1, np.float32), 1, tag=6)
        except commrt.PeerLost:
            pass  # rank 1 left, which it does only after its receive
    else:  # alive until rank 0 is done: only the last rank is lost
        commrt.recv(np.empty(1, np.float32), 0, tag=5)
        commrt.send(np.ones(1, np.float32), 0, tag=6)
    os._exit(0)  # the survivors' teardown would wait on the dead rank


def main() -> int:
    mode = sys.argv[1]
    commrt.init_process_group()
    if mode == "dead":
        return dead(commrt.get_rank(), commrt.get_world_size())
    (match if mode == "match" else silent)(commrt.get_rank(), commrt.get_world_size())
    commrt.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
