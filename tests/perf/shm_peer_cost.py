"""CPU cost of the small shared-memory all-reduce's work per peer, in one process (issue 32).

    python -m tests.perf.shm_peer_cost 2 3 4 8 16

For n ranks and a 4 KiB float32 part: the byte counters (one fan-out update per op, against
the former four updates per peer), the header check (one loop over live views of the control
pages, against the former per-peer method calls that also read every aux word), and the
reduction (one numpy call per peer, reduce_arrays_, against one call over the rows,
reduce_rows_: the crossover sets shm_ops.ROWS_REDUCE_FROM). The per-peer forms are kept here
as the baseline they were. Minimum of 7 repeats of 20,000 calls.
"""
from __future__ import annotations

import sys
import timeit

import numpy as np

from commrt.collectives.reduce_ops import ReduceOp, reduce_arrays_, reduce_rows_
from commrt.transport.transport import Counters

NUMEL = 1024


def costs(n: int) -> dict[str, tuple[float, float]]:
    counters = Counters()
    names = [f"rank{r}" for r in range(n)]
    peers = list(range(1, n))
    per_peer = [counters.peer(x) for x in names]
    sent, msgs = counters.op_table(), counters.op_table(messages=True)
    fan = counters.fanout_table(names[1:])

    def count_per_peer():
        for dst in peers:
            c = per_peer[dst]
            c.sent_bytes += 4 * NUMEL
            c.sent_msgs += 1
            key = (1, 4, names[dst])
            sent[key] = sent.get(key, 0) + 4 * NUMEL
            msgs[key] = msgs.get(key, 0) + 1

    def count_fanout():
        row = fan.get((1, 4))
        if row is None:
            row = fan[(1, 4)] = [0, 0]
        row[0] += 4 * NUMEL
        row[1] += 1

    ctl = [memoryview(np.zeros(64, np.int64)) for _ in range(n)]
    hdr = [[c[8:15], c[16:23]] for c in ctl]
    peer_hdr = [(p, hdr[p][0]) for p in peers]

    def same(p: int, slot: int) -> bool:
        return hdr[p][slot] == hdr[0][slot]

    def aux(p: int, slot: int) -> int:
        return ctl[p][8 + 8 * (slot + 1) - 1]

    def headers_per_peer():
        got = [0] * n
        for p in range(n):
            if p == 0:
                continue
            if not same(p, 0):
                raise AssertionError(p)
            got[p] = aux(p, 0)

    def headers_loop():
        mine = hdr[0][0]
        for p, h in peer_hdr:
            if h != mine:
                return p
        return None

    row = -(-NUMEL * 4 // 64) * 64
    rows = np.ndarray((n, NUMEL), np.float32, buffer=np.zeros(n * row, np.uint8), strides=(row, 4))
    rows[:] = 1.0
    parts, out = list(rows), np.zeros(NUMEL, np.float32)
    t = lambda f: min(timeit.repeat(f, number=20000, repeat=7)) / 20000 * 1e6  # noqa: E731
    return {"counters": (t(count_per_peer), t(count_fanout)), "headers": (t(headers_per_peer), t(headers_loop)),
            "reduce": (t(lambda: reduce_arrays_(out, parts, ReduceOp.SUM)),
                       t(lambda: reduce_rows_(out, rows, ReduceOp.SUM)))}


def main(argv: list[str]) -> int:
    print("ranks  counters: per peer / fan-out   headers: per peer / loop   reduce: per part / rows  (us)")
    for n in [int(a) for a in argv] or [2, 4, 8, 16]:
        c = costs(n)
        print(f"{n:5d}  " + "   ".join(f"{k} {a:6.2f} / {b:6.2f}" for k, (a, b) in c.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
