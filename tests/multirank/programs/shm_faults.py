"""Failures on the shared-memory path; every rank prints the name of the segment it made.

    shm_faults MODE   with MODE in
      setup-kill   rank 1 is SIGKILLed while mapping its peers' segments (before anyone unlinked)
      mismatch     rank 1 calls all_reduce with another count than the others
      garbage      rank 1 scribbles over its own control page (step headers) mid-job
"""
from __future__ import annotations

import os
import signal
import sys

import torch

import commrt
from commrt.transport import shm

RANK = int(os.environ["RANK"])
VICTIM = 1


def _announce_segments() -> None:
    made, attach = shm.create, shm.attach

    def create(*a, **k):
        name, mm = made(*a, **k)
        print(f"segment: {name}", flush=True)
        return name, mm

    def attach_or_die(*a, **k):
        if RANK == VICTIM and MODE == "setup-kill":
            os.kill(os.getpid(), signal.SIGKILL)
        return attach(*a, **k)
    shm.create, shm.attach = create, attach_or_die


def main() -> int:
    _announce_segments()
    try:
        commrt.init_process_group()
        if MODE == "mismatch":
            commrt.all_reduce(torch.ones(10 + (RANK == VICTIM)))
        elif MODE == "garbage":
            commrt.all_reduce(torch.ones(10))
            if RANK == VICTIM:
                ctl = commrt.distributed._rt().world.backend._shm.ctl[RANK]
                for w in range(shm.HDR_BASE, shm.ATTACH_BASE):
                    ctl[w] = -(1 << 62) + w
            commrt.all_reduce(torch.ones(1000))
        print("NOT CAUGHT", flush=True)
    except commrt.CommError as exc:
        print(f"CAUGHT {type(exc).__name__}: {exc}", flush=True)
    return 0


if __name__ == "__main__":
    MODE = sys.argv[1]
    sys.exit(main())
