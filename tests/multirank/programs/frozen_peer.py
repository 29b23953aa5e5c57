"""A rank freezes (SIGSTOP) in a broadcast; every survivor must raise PeerLost naming it,
through liveness (the dropped connection or the missed heartbeats), not the op timeout.

    frozen_peer chain      3 ranks, a 64 MiB chain broadcast from rank 0, rank 1 frozen: rank
                           0 is blocked handing its pieces to rank 1 (a send that does not
                           drain), not in a receive
    frozen_peer binomial   5 ranks, a binomial broadcast from rank 2, rank 4 frozen: rank 0
                           waits on rank 4 while ranks 1 and 3 get their copies from the root,
                           finish and leave cleanly (destroy the group: a goodbye); rank 0 must
                           name rank 4, not a rank that left. (Rank 0 is the one waiting: it
                           serves the store, whose shutdown would wait 10 s for the frozen rank.)

The victim is woken after WAKE_S and then exits, so no process outlives the test.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np

import commrt

RANK = int(os.environ["RANK"])
WAKE_S = 4


def freeze() -> None:
    subprocess.Popen(["sh", "-c", f"sleep {WAKE_S}; kill -CONT {os.getpid()}"], start_new_session=True)
    os.kill(os.getpid(), signal.SIGSTOP)
    os._exit(0)


def main() -> int:
    shape = sys.argv[1]
    root, victim, numel = (0, 1, 16 << 20) if shape == "chain" else (2, 4, 1 << 10)
    commrt.init_process_group()
    commrt.all_reduce(np.ones(10, np.float32))
    n = commrt.get_world_size()  # every rank sends to every other: each pair connected both ways,
    commrt.all_to_all_single(np.empty(n, np.float32), np.ones(n, np.float32))  # so no goodbye needs a fresh dial
    data = np.full(numel, 7.0, np.float32) if RANK == root else np.zeros(numel, np.float32)
    if RANK == victim:  # frozen before the broadcast: nothing of it reaches the others
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
    commrt.destroy_process_group()  # leave cleanly, while rank 0 may still wait on the victim
    return 0


if __name__ == "__main__":
    sys.exit(main())
