"""A receive from any source, then collectives; every rank writes its flight record
(``dump_flight_record``) for the test to analyse: the same collectives, the same seqs."""
from __future__ import annotations

import sys

import numpy as np

import commrt


def main() -> int:
    commrt.init_process_group()
    rank = commrt.get_rank()
    commrt.all_reduce(np.ones(4, np.float32))
    if rank == 0:
        commrt.recv(np.empty(3, np.float32))  # from any source
    elif rank == 1:
        commrt.send(np.ones(3, np.float32), 0)
    commrt.all_reduce(np.ones(8, np.float32))
    commrt.broadcast(np.ones(2, np.float64), src=0)
    commrt.dump_flight_record("checked by the test")
    commrt.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
