"""An async gloo all_reduce whose end the program learns only later: the comms log must time it
to when it completed, not to the program's wait. Each rank notes a time after the op has
completed in torch (a callback of torch's future, registered after commrt's, has run), then
waits; prints ``ENDED BEFORE WAIT`` when the op's record ended no later than that time."""
from __future__ import annotations

import sys
import threading
import time

import torch

import commrt


def main() -> int:
    commrt.init_process_group()
    commrt.all_reduce(torch.ones(4))
    work = commrt.all_reduce(torch.ones(1 << 16), async_op=True)
    ran = threading.Event()
    work._inner.get_future().add_done_callback(lambda _: ran.set())  # runs after commrt's, in order
    assert ran.wait(30)
    marked = time.perf_counter()  # the program's compute would go here
    work.wait()
    ended = work._flight.ended
    print("ENDED BEFORE WAIT" if ended <= marked else f"ENDED AT WAIT: {ended - marked:+.6f} s", flush=True)
    row = next(r for r in commrt.comms_summary() if r["bucket"] == 1 << 18)
    assert row["count"] == 1 and row["backend"] == "gloo", row
    commrt.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
