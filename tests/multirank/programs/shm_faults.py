"""Failures on the shared-memory path; every rank prints its pid.

    shm_faults MODE   with MODE in
      setup-kill   rank 1 is SIGKILLed while mapping the segments its peers handed it
      handoff-kill rank 1 is SIGKILLed with its segment made and its handoff socket listening,
                   before it served or fetched any descriptor
      mismatch     rank 1 calls all_reduce with another count than the others
      garbage      rank 1 publishes a step whose header is garbage mid-job
"""
from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np

import commrt
from commrt.transport import handoff, shm

RANK = int(os.environ["RANK"])
VICTIM = 1


def _kill_in_setup() -> None:
    attach, exchange = shm.attach, handoff.Handoff.exchange

    def attach_or_die(*a, **k):
        if RANK == VICTIM and MODE == "setup-kill":
            os.kill(os.getpid(), signal.SIGKILL)
        return attach(*a, **k)

    def exchange_or_die(*a, **k):
        if RANK == VICTIM and MODE == "handoff-kill":
            time.sleep(0.5)  # let the peers connect to our socket and wait on us
            os.kill(os.getpid(), signal.SIGKILL)
        return exchange(*a, **k)
    shm.attach, handoff.Handoff.exchange = attach_or_die, exchange_or_die


def main() -> int:
    print(f"pid: {os.getpid()}", flush=True)
    _kill_in_setup()
    try:
        commrt.init_process_group()
        if MODE == "mismatch":
            commrt.all_reduce(np.ones(10 + (RANK == VICTIM), np.float32))
        elif MODE == "garbage":
            commrt.all_reduce(np.ones(10, np.float32))
            if RANK == VICTIM:  # garbage in the next step's header, published as if it were one
                channel = commrt.distributed._rt().world.backend._shm
                ctl, t = channel.ctl[RANK], channel.t + 1
                for w in range(shm.HDR_BASE, shm.ATTACH_BASE):
                    ctl[w] = -(1 << 62) + w
                ctl[shm.HDR_BASE + shm.HDR_WORDS * (t & 1)] = t  # the step word right, the rest garbage
                ctl[shm.W_COUNTER] = t
                time.sleep(2)  # rank 0 is already waiting for step t: let it read the garbage before
                # our own all_reduce writes a real header over it
            commrt.all_reduce(np.ones(1000, np.float32))  # rank 1's completes: rank 0 published valid data first
            commrt.all_reduce(np.ones(10, np.float32))  # ... and its next op finds rank 0 gone
        print("NOT CAUGHT", flush=True)
    except commrt.CommError as exc:
        print(f"CAUGHT {type(exc).__name__}: {exc}", flush=True)
    return 0


if __name__ == "__main__":
    MODE = sys.argv[1]
    sys.exit(main())
