"""What one new_group costs each rank on a zmq world (issue 32.5), before and after its members
learnt their partners' addresses through the store, at n ranks as nodes of 8 on this host:

    flock -x /tmp/w/cpu.lock python -m tests.perf.group_costs 8 64

One launch per size; each rank, for each group (a pair across nodes, node 0, one rank per node,
the whole world): ``before`` replays the exchange new_group ran until this change (every world
rank all-gathers a 256-byte address row from every rank over the world backend, members or not);
``after`` is new_group itself, then one 4 KiB all_reduce on the group (checked exactly against the
single-process sum), after which a member has read the partners it dialled. Counted on each rank:
messages and bytes it sent on any socket (peers and the store) and group entries it read from the
store and their bytes (comm_stats()["rendezvous"]). TCP only (no shared memory: every group reads lazily).
"""
from __future__ import annotations

import io
import os
import re
import sys

PER_NODE = 8
ADDR_BYTES = 256  # the old exchange's row per rank


def _groups(n: int) -> dict[str, list[int]]:
    return {"pair": [0, n // 2], "node": list(range(min(PER_NODE, n))),
            "per-node": list(range(0, n, PER_NODE)), "world": list(range(n))}


def rank() -> None:
    import numpy as np
    import commrt
    r, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    commrt.init_process_group()
    rt = commrt.distributed._rt()

    def sent() -> tuple[int, int]:
        snap = rt.transport.counters.snapshot().values()
        return sum(c["sent_msgs"] for c in snap), sum(c["sent_bytes"] for c in snap)

    def reads() -> tuple[int, int]:
        got = commrt.comm_stats()["rendezvous"]
        return got["group_addresses_read"], got["group_address_bytes"]

    for name, ranks in _groups(n).items():
        m0, b0 = sent()
        table = np.empty(ADDR_BYTES * n, np.uint8)
        rt.world.backend.all_gather_into_tensor(table, np.zeros(ADDR_BYTES, np.uint8))  # the old exchange
        m1, b1 = sent()
        read0 = reads()
        g = commrt.new_group(ranks)
        m2, b2 = sent()
        if g is not commrt.NON_GROUP_MEMBER:
            x = np.full(512, r + 1, np.int64)
            commrt.all_reduce(x, group=g)
            assert (x == sum(p + 1 for p in ranks)).all(), f"rank {r}: all_reduce on {name}"
        member = int(r in ranks)
        print(f"GROUPCOST {r} {name} {member} {m1 - m0} {b1 - b0} {m2 - m1} {b2 - b1} {reads()[0] - read0[0]} "
              f"{reads()[1] - read0[1]}", flush=True)
    commrt.destroy_process_group()


def one(n: int) -> list[str]:
    from commrt.launch import Nodes, launch
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root, "COMMRT_COMM_BACKEND": "zmq", "COMMRT_COMM_INTRA_NODE": "tcp",
           "COMMRT_COMM_TIMEOUT_S": "300", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    out = io.StringIO()
    result = launch(min(PER_NODE, n), [sys.executable, "-m", "tests.perf.group_costs", "--rank"], out=out,
                    timeout_s=1200, env=env, nodes=Nodes(max(1, n // PER_NODE), None))
    rows = re.findall(r"GROUPCOST (\d+) (\S+) (\d) (\d+) (\d+) (\d+) (\d+) (\d+) (\d+)", out.getvalue())
    if result.returncode != 0 or len(rows) != n * len(_groups(n)):
        raise SystemExit(f"x{n}: {result.describe()}\n{out.getvalue()[-4000:]}")
    lines = []
    for name, ranks in _groups(n).items():
        mine = [[int(v) for v in row[2:]] for row in rows if row[1] == name]
        old = max(v[2] for v in mine), max(v[1] for v in mine)  # bytes, messages
        mem = [v for v in mine if v[0]]
        non = [v for v in mine if not v[0]]
        lines.append(f"| {n} | {name} ({len(ranks)}) | {old[0]} / {old[1]} | "
                     f"{max(v[4] for v in mem)} / {max(v[3] for v in mem)} | {max(v[5] for v in mem)} / "
                     f"{max(v[6] for v in mem)} | "
                     + (f"{max(v[4] for v in non)} / {max(v[3] for v in non)} |" if non else "- |"))
    return lines


def main(sizes: list[int]) -> None:
    print("| ranks | group (members) | before, every rank: bytes / messages sent | after, a member: "
          "bytes / messages sent in new_group (max) | then entries / bytes it read (max) | "
          "after, a non-member: bytes / messages |")
    print("|---:|---|---:|---:|---:|---:|")
    for n in sizes:
        for line in one(n):
            print(line, flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["--rank"]:
        rank()
    else:
        main([int(a) for a in sys.argv[1:]] or [8, 64])
