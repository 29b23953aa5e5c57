"""One rank dies (or freezes) in the middle of a large all_reduce; every survivor must raise
PeerLost naming it, the op and the sequence number (and report how long that took).

    faults MODE   with MODE in exit0 | exit1 | abort | sigkill | sigterm | sigstop
    faults MODE subgroup   4 ranks: global rank 2 dies in an all_reduce of the group [0, 2],
                           where it is rank 1; rank 0 must name rank 2
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np

import commrt

RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
VICTIM = 1


def die(mode: str) -> None:
    if mode == "exit0":
        os._exit(0)
    if mode == "exit1":
        os._exit(1)
    if mode == "abort":
        os.abort()
    if mode == "sigstop":  # frozen: the sockets stay open; woken after 6 s (then exits: either
        # way, missed heartbeats or the dropped connection, the survivors must name rank 1)
        subprocess.Popen(["sh", "-c", f"sleep 6; kill -CONT {os.getpid()}"], start_new_session=True)
        os.kill(os.getpid(), signal.SIGSTOP)
        os._exit(0)
    os.kill(os.getpid(), {"sigkill": signal.SIGKILL, "sigterm": signal.SIGTERM}[mode])
    time.sleep(10)


def subgroup(mode: str) -> int:
    commrt.init_process_group()
    groups = [commrt.new_group([0, 2]), commrt.new_group([1, 3])]
    group = groups[RANK % 2]
    commrt.all_reduce(np.ones(10, np.float32), group=group)
    if RANK % 2:
        return 0
    big = np.ones(16 << 20, np.float32)
    if RANK == 2:
        commrt.all_reduce(big, group=group, async_op=True)
        time.sleep(0.01)
        die(mode)
    try:
        commrt.all_reduce(big, group=group)
        print("NOT CAUGHT: the collective completed without the victim", flush=True)
    except commrt.PeerLost as exc:
        print(f"CAUGHT PeerLost: {exc} (rank attribute {exc.rank})", flush=True)
    return 0


def main() -> int:
    mode = sys.argv[1]
    if sys.argv[2:] == ["subgroup"]:
        return subgroup(mode)
    commrt.init_process_group()
    commrt.all_reduce(np.ones(10, np.float32))  # seq 2 (the init barrier was seq 1)
    big = np.ones(64 << 20, np.float32)  # 256 MiB: well over 0.1 s of ring traffic even on a quiet machine
    if RANK == VICTIM:
        commrt.all_reduce(big, async_op=True)
        time.sleep(0.01)
        die(mode)
    started = time.monotonic()
    try:
        commrt.all_reduce(big)
        print("NOT CAUGHT: the collective completed without the victim", flush=True)
    except commrt.PeerLost as exc:
        print(f"CAUGHT PeerLost: {exc} (detected after {time.monotonic() - started:.2f}s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
