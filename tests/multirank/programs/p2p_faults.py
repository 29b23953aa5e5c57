"""Point-to-point errors in a subgroup name global ranks, and a failed receive loses nothing
after it. Three ranks; the group is global ranks [1, 2], where global rank 1 is group rank 0.

    p2p_faults MODE   with MODE in
      mismatch  rank 1 sends rank 2 a message of 4 pieces where rank 2's receive holds one piece
                of another dtype: a CollectiveMismatch naming ranks 2 and 1; rank 1's next
                messages (one piece, then 4) arrive intact in the next receives
      sigkill   rank 1 dies while rank 2 waits for its message: a PeerLost naming rank 1
      sigstop   rank 1 freezes (6 s, then exits) while rank 2 waits: a PeerLost naming rank 1,
                through the missed heartbeats, long before the op timeout
      sendlost  rank 2 dies; rank 1 sends it 1 MiB messages until one fails: a PeerLost naming
                rank 2, through liveness too (ZeroMQ holds what a dead peer cannot take)
      sendstop  the same with rank 2 frozen (6 s, then exits): its missed heartbeats tell
The survivor in the group prints what it caught and when; rank 0 (outside the group) waits for
its word."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np

import commrt

PIECE = 1 << 14  # float32 elements of one piece (COMMRT_COMM_CHUNK_BYTES = 64 KiB)


def payload(numel: int, i: int) -> np.ndarray:
    return np.arange(numel, dtype=np.float32) + 1000 * i


def mismatch(rank: int, group) -> None:
    if rank == 1:
        for i, numel in enumerate((4 * PIECE, PIECE, 4 * PIECE)):
            commrt.send(payload(numel, i), 2, group=group)
        commrt.recv(np.empty(1, np.float32), 2, group=group, tag=9)  # alive until rank 2 has them all
        return
    try:
        commrt.recv(np.empty(PIECE, np.int32), 1, group=group)
        print("NOT CAUGHT: a mismatched receive completed", flush=True)
    except commrt.CollectiveMismatch as exc:
        print(f"CAUGHT CollectiveMismatch: {exc} (rank {exc.rank}, peer {exc.peer})", flush=True)
    for i, numel in ((1, PIECE), (2, 4 * PIECE)):
        got = np.full(numel, -1.0, np.float32)
        commrt.recv(got, 1, group=group)
        assert np.array_equal(got, payload(numel, i)), (i, got[:4])
    print("the next messages arrived intact", flush=True)
    commrt.send(np.ones(1, np.float32), 1, group=group, tag=9)


def lost(rank: int, group, mode: str) -> None:
    if rank == 1:
        commrt.send(np.ones(4, np.float32), 2, group=group)  # rank 2's receive waits on us: dialled
        commrt.recv(np.empty(1, np.float32), 2, group=group, tag=9)  # rank 2 has it: now go
        if mode == "sigstop":  # frozen: only the heartbeats tell
            freeze()
        os.kill(os.getpid(), signal.SIGKILL)
    commrt.recv(np.empty(4, np.float32), 1, group=group)
    commrt.send(np.ones(1, np.float32), 1, group=group, tag=9)
    start = time.monotonic()
    try:
        commrt.recv(np.empty(4, np.float32), 1, group=group)
        print("NOT CAUGHT: a receive from a lost rank completed", flush=True)
    except commrt.PeerLost as exc:
        print(f"CAUGHT PeerLost: {exc} (rank {exc.rank}, after {time.monotonic() - start:.1f}s)", flush=True)


def freeze() -> None:
    """SIGSTOP this process, SIGCONT it 6 s later (it then exits): the sockets stay open meanwhile."""
    subprocess.Popen(["sh", "-c", f"sleep 6; kill -CONT {os.getpid()}"], start_new_session=True)
    os.kill(os.getpid(), signal.SIGSTOP)
    os._exit(0)


def send_lost(rank: int, group, mode: str) -> None:
    if rank == 2:
        commrt.recv(np.empty(1, np.float32), 1, group=group)  # rank 1's socket to us is up
        freeze() if mode == "sendstop" else os.kill(os.getpid(), signal.SIGKILL)
    commrt.send(np.ones(1, np.float32), 2, group=group)
    start = time.monotonic()
    try:
        for _ in range(100000):  # 100 GiB: a ring and a socket's worth are taken at once
            commrt.send(np.ones(1 << 18, np.float32), 2, group=group)
        print("NOT CAUGHT: every send to a lost rank completed", flush=True)
    except commrt.PeerLost as exc:
        print(f"CAUGHT PeerLost: {exc} (rank {exc.rank}, after {time.monotonic() - start:.1f}s)", flush=True)


def main() -> int:
    mode = sys.argv[1]
    commrt.init_process_group()
    rank = commrt.get_rank()
    group = commrt.new_group([1, 2])
    if mode == "mismatch":
        if rank:
            mismatch(rank, group)
        commrt.barrier()
        commrt.destroy_process_group()
        return 0
    if rank:
        send_lost(rank, group, mode) if mode.startswith("send") else lost(rank, group, mode)
    survivor = 1 if mode.startswith("send") else 2
    if rank == survivor:  # rank 0 stays until we leave (a send is buffered; the last to go loses nothing)
        commrt.send(np.ones(1, np.float32), 0, tag=9)
        commrt.recv(np.empty(1, np.float32), 0, tag=10)
    elif rank == 0:
        commrt.recv(np.empty(1, np.float32), survivor, tag=9)
        commrt.send(np.ones(1, np.float32), survivor, tag=10)
        try:
            commrt.recv(np.empty(1, np.float32), survivor, tag=11)
        except commrt.PeerLost:
            pass  # the survivor left, which it does only after our word
    os._exit(0)  # the world's teardown would wait on the lost rank


if __name__ == "__main__":
    sys.exit(main())
