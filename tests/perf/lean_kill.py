"""Where the time goes when one of N numpy-only ranks is SIGKILLed (the slow 256-rank test's kill):
the ranks that saw the victim's connection drop themselves, then each rank told by a notice, by
hop (how many ranks the notice went through), on the host's monotonic clock from the kill.

    flock /work/notes/bench.lock python -m tests.perf.lean_kill 256 [VICTIM] [OUT.log]

One launch of tests/multirank/programs/lean_rank.py kill (the test's settings: TCP, 3 s
heartbeats); OUT.log keeps the whole output. Reads the victim's KILLED line and each survivor's
CAUGHT line (its time on the host's clock, and the rank whose notice told it).
"""
from __future__ import annotations

import re
import statistics
import sys

from tests.multirank.lean import launch

KILLED = re.compile(r"KILLED rank (\d+) at ([\d.]+)")
CAUGHT = re.compile(r"CAUGHT rank (\d+) PeerLost rank (\d+) after ([\d.]+)s at ([\d.]+) told by (-|\d+)")


def breakdown(out: str) -> str:
    """The table: per hop, how many ranks and when (seconds after the kill) they named the victim."""
    kill = float(KILLED.search(out).group(2))
    caught = {int(r): (float(at) - kill, None if by == "-" else int(by), float(after))
              for r, _, after, at, by in CAUGHT.findall(out)}

    def hops(rank: int) -> int:
        """Ranks the notice went through to reach ``rank`` (0: it saw the victim go itself)."""
        seen, n = set(), 0
        while rank in caught and caught[rank][1] is not None and rank not in seen:
            seen.add(rank)
            rank, n = caught[rank][1], n + 1
        return n

    by_hop: dict[int, list[float]] = {}
    for r in caught:
        by_hop.setdefault(hops(r), []).append(caught[r][0])
    lines = [f"{len(caught)} survivors named the victim; seconds after the kill (first / median / last):"]
    for h in sorted(by_hop):
        t = sorted(by_hop[h])
        lines.append(f"  hop {h}: {len(t):3d} ranks  {t[0]:6.2f} / {statistics.median(t):6.2f} / {t[-1]:6.2f}")
    # a hop: a told rank's time after its teller's, where the teller was told too (a rank that
    # saw the victim go itself tells every peer before its own PeerLost reaches its caller)
    delays = sorted(caught[r][0] - caught[caught[r][1]][0] for r in caught
                    if caught[r][1] is not None and caught.get(caught[r][1], (0, None))[1] is not None)
    if delays:
        lines.append(f"  a hop (told by a told rank): median {statistics.median(delays):.2f} s, "
                     f"90% {delays[int(0.9 * (len(delays) - 1))]:.2f} s, max {delays[-1]:.2f} s")
    last = max(caught, key=lambda r: caught[r][0])
    lines.append(f"  slowest: rank {last} at {caught[last][0]:.2f} s after the kill "
                 f"({caught[last][2]:.2f} s after its barrier), hop {hops(last)}")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    n = int(argv[0]) if argv else 256
    victim = int(argv[1]) if len(argv) > 1 else n // 2 + 1
    path = argv[2] if len(argv) > 2 else f"/tmp/lean_kill_{n}.log"
    _, out, rows = launch(n, "kill", str(victim), "10", timeout_s=900, env={"COMMRT_COMM_HEARTBEAT_S": "3"},
                          stop_on_failure=False, expect_fail=True)
    with open(path, "w") as fh:
        fh.write(out)
    print(f"{n} ranks, rank {victim} killed; output in {path}")
    print(breakdown(out))


if __name__ == "__main__":
    main(sys.argv[1:])
