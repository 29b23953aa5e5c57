"""Where a training step's collective time goes: waiting for the last rank to arrive (skew: its
peers still computing) or the op itself once every rank is in it. Reads the ranks' Perfetto
traces (``[log] trace_file``; one file per rank) of one run and matches each collective across
ranks by its sequence number:

    COMMRT_LOG_TRACE_FILE=/tmp/tr/dp.json commrt bench train -n 8 --stages dp --peers '' ...
    python -m tests.perf.op_skew /tmp/tr/dp.json [--min-bytes 1048576]

For each op name and size: how many ops, the mean spread of the ranks' starts (last start minus
first), the mean time from the last start to the last end (what the op costs once all ranks are
in it), and the op's time alone in ``commrt bench all_reduce`` is the figure to set it against.
A start is when the rank began the op (the trace event's start: after any earlier async op of
its group finished, ``queued_us`` after its issue).
"""
from __future__ import annotations

import argparse
import collections
import statistics

from commrt.obs.trace import merge, rank_files


def ops_by_seq(events_by_rank: dict[int, list[dict]], min_bytes: int) -> dict[tuple, dict[int, tuple]]:
    """{(group, seq, name, bytes): {rank: (start_us, end_us)}} for the comm events."""
    out: dict[tuple, dict[int, tuple]] = collections.defaultdict(dict)
    for rank, events in events_by_rank.items():
        for e in events:
            args = e.get("args") or {}
            if e.get("ph") != "X" or e.get("cat") != "comm" or "seq" not in args:
                continue
            if args.get("bytes", 0) < min_bytes:
                continue
            out[(e["tid"], args["seq"], e["name"], args.get("bytes", 0))][rank] = (e["ts"], e["ts"] + e["dur"])
    return out


def summary(ops: dict[tuple, dict[int, tuple]], ranks: int) -> list[dict]:
    rows: dict[tuple, list[tuple[float, float]]] = collections.defaultdict(list)
    for (group, _seq, name, nbytes), by_rank in ops.items():
        if len(by_rank) != ranks:
            continue  # a subgroup's op, or one a rank's trace lacks
        starts = [s for s, _ in by_rank.values()]
        ends = [e for _, e in by_rank.values()]
        rows[(group, name, nbytes)].append((max(starts) - min(starts), max(ends) - max(starts)))
    return [{"group": g, "op": name, "bytes": nbytes, "count": len(v),
             "skew_us": statistics.mean(s for s, _ in v), "op_us": statistics.mean(o for _, o in v),
             "op_us_median": statistics.median(o for _, o in v)}
            for (g, name, nbytes), v in sorted(rows.items())]


def arrivals(events_by_rank: dict[int, list[dict]], op: str, nbytes: int) -> None:
    """For each op ``op`` of ``nbytes``: each rank's forward start and its arrival at the op,
    relative to the first rank's forward start of that step (the k-th forward span before it):
    whether a late rank started its step late or computed longer."""
    ops = ops_by_seq(events_by_rank, nbytes)
    rows = sorted((seq, by_rank) for (_, seq, name, b), by_rank in ops.items() if name == op and b == nbytes
                  and len(by_rank) == len(events_by_rank))
    fwd = {r: sorted(e["ts"] for e in ev if e.get("name") == "forward" and e.get("ph") == "X")
           for r, ev in events_by_rank.items()}
    print(f"# {op} of {nbytes} B: per step, rank: forward start / arrival at the op (ms after the first forward start)")
    for seq, by_rank in rows:
        starts = {r: max((t for t in fwd[r] if t <= by_rank[r][0]), default=by_rank[r][0]) for r in by_rank}
        base = min(starts.values())
        late = max(by_rank, key=lambda r: by_rank[r][0])
        print(f"seq {seq}: " + "  ".join(f"{r}:{(starts[r] - base) / 1e3:.0f}/{(by_rank[r][0] - base) / 1e3:.0f}"
                                          for r in sorted(by_rank)) + f"   last: rank {late}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="the [log] trace_file template, or the ranks' files")
    p.add_argument("--min-bytes", type=int, default=1 << 16)
    p.add_argument("--arrivals", metavar="OP:BYTES", help="per step, each rank's forward start and arrival at this op")
    args = p.parse_args()
    by_rank: dict[int, list[dict]] = collections.defaultdict(list)
    for e in merge(rank_files([args.trace])):
        by_rank[e["pid"]].append(e)
    rows = summary(ops_by_seq(by_rank, args.min_bytes), len(by_rank))
    print(f"# {len(by_rank)} ranks; skew: last rank's start - first's; op: last end - last start (us)")
    print(f"{'group':>5s} {'op':>16s} {'bytes':>10s} {'count':>5s} {'skew us':>10s} {'op us':>10s} {'op median':>10s}")
    for r in rows:
        print(f"{r['group']:5d} {r['op']:>16s} {r['bytes']:10d} {r['count']:5d} {r['skew_us']:10.0f} "
              f"{r['op_us']:10.0f} {r['op_us_median']:10.0f}")
    if args.arrivals:
        op, _, nbytes = args.arrivals.partition(":")
        arrivals(by_rank, op, int(nbytes))


if __name__ == "__main__":
    main()
