"""Rank 0 gives up waiting for an async all_reduce (``Work.wait(timeout)``) that rank 1 joins
late, then waits it out; prints ``CAUGHT <type>`` for the timeout. The test reads rank 0's
flight record, which the timeout must have written."""
from __future__ import annotations

import sys
import time

import torch

import commrt


def main() -> int:
    commrt.init_process_group()
    commrt.all_reduce(torch.ones(4))
    if commrt.get_rank() == 1:
        time.sleep(3)
        commrt.all_reduce(torch.ones(4))
    else:
        work = commrt.all_reduce(torch.ones(4), async_op=True)
        try:
            work.wait(timeout=0.5)
        except commrt.CommError as exc:
            print(f"CAUGHT {type(exc).__name__}", flush=True)
        work.wait()
    commrt.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
