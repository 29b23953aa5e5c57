"""Rank 1 freezes (SIGSTOP) in a broadcast; every survivor must raise PeerLost naming rank 1,
through liveness (the dropped connection or the missed heartbeats), not the op timeout.

    frozen_peer chain      3 ranks, a 64 MiB chain broadcast from rank 0: rank 0 is blocked
                           handing its pieces to rank 1 (a send that does not drain), not in a
                           receive
    frozen_peer binomial   5 ranks, a binomial broadcast from rank 4: rank 3 gets its copy
                           from the root, finishes and leaves cleanly while rank 2 still waits
                           on rank 1; rank 2 must name rank 1, not the rank that left

Rank 1 is woken after WAKE_S and then exits, so no process outlives the test.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import torch

import commrt

RANK = int(os.environ["RANK"])
VICTIM, WAKE_S = 1, 4


def freeze() -> None:
    subprocess.Popen(["sh", "-c", f"sleep {WAKE_S}; kill -CONT {os.getpid()}"], start_new_session=True)
    os.kill(os.getpid(), signal.SIGSTOP)
    os._exit(0)


def main() -> int:
    shape = sys.argv[1]
    root, numel = (0, 16 << 20) if shape == "chain" else (4, 1 << 10)
    commrt.init_process_group()
    commrt.all_reduce(torch.ones(10))  # every pair of ranks connected before the fault
    data = torch.full((numel,), 7.0) if RANK == root else torch.zeros(numel)
    if RANK == VICTIM:  # frozen before the broadcast: nothing of it reaches the others
        freeze()
    time.sleep(0.1)  # the victim is stopped by now (its I/O thread too: it reads nothing)
    started = time.monotonic()
    try:
        commrt.broadcast(data, src=root)
    except commrt.PeerLost as exc:
        print(f"CAUGHT PeerLost: {exc} (rank attribute {exc.rank}, after "
              f"{time.monotonic() - started:.2f}s)", flush=True)
        return 0
    if not bool((data == 7.0).all()):
        raise AssertionError(f"rank {RANK}: wrong broadcast result")
    print(f"FINISHED rank {RANK}", flush=True)
    return 0  # and leave, while the others may still wait on rank 1


if __name__ == "__main__":
    sys.exit(main())
