"""Issues a known list of ops with ``[log] comms = true`` and prints the comms summary as JSON
(``SUMMARY <json>``): the test compares its counts and bytes with what this program issued."""
from __future__ import annotations

import json
import sys

import numpy as np

import commrt


def main() -> int:
    commrt.init_process_group()
    rank, world = commrt.get_rank(), commrt.get_world_size()
    for _ in range(3):
        commrt.all_reduce(np.ones(1000, np.float32))  # 4000 B each
    works = [commrt.all_gather_into_tensor(np.empty(256 * world, np.float32), np.ones(256, np.float32), async_op=True)
             for _ in range(2)]  # 1024 B x world each, async: completion seen through Work
    for w in works:
        w.wait()
    commrt.broadcast(np.ones(10, np.float64), src=0)  # 80 B
    pair = commrt.new_group([0, 1])
    if rank < 2:
        commrt.all_reduce(np.ones(5, np.int64), group=pair)  # 40 B on the pair
        if rank == 0:
            commrt.send(np.ones(7, np.float32), 1, group=pair)  # 28 B
        else:
            commrt.recv(np.empty(7, np.float32), 0, group=pair)
    commrt.barrier()
    print("SUMMARY " + json.dumps(commrt.comms_summary()), flush=True)
    commrt.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
