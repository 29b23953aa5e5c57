"""How long the ZeroMQ I/O threads of a job wait for a CPU. Run beside a job: every 0.5 s it
reads run_delay (time runnable but not running, /proc/<pid>/task/<tid>/schedstat) of every
ZMQbg/IO thread below ROOT_PID, and writes each thread that waited over 1 s within a 3 s window,
and the load. It showed that 256 ranks on 2 cores starve the I/O threads past libzmq's heartbeat
timeout (docs/PERFORMANCE.md). Reads /proc only; stops when ROOT_PID ends or after 20 minutes.

    python -m tests.perf.io_thread_waits ROOT_PID OUT.log
"""
from __future__ import annotations

import collections
import os
import sys
import time

WINDOW_S, REPORT_S, LIMIT_S = 3.0, 1.0, 1200.0


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as fh:
                    kids = [int(x) for x in fh.read().split()]
                found += kids
                todo += kids
        except OSError:
            continue
    return found


def io_threads(pid: int):
    """(tid, run_delay seconds) of the process's ZeroMQ I/O threads."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as fh:
                if not fh.read().startswith("ZMQbg/IO"):
                    continue
            with open(f"/proc/{pid}/task/{tid}/schedstat") as fh:
                yield tid, int(fh.read().split()[1]) / 1e9
        except OSError:
            continue


def main(root: int, out: str) -> None:
    seen: dict = collections.defaultdict(collections.deque)  # (pid, tid) -> (time, run_delay)
    start = time.monotonic()
    with open(out, "w") as log:
        while os.path.exists(f"/proc/{root}") and time.monotonic() - start < LIMIT_S:
            now = time.monotonic()
            for pid in descendants(root):
                for tid, delay in io_threads(pid):
                    h = seen[(pid, tid)]
                    h.append((now, delay))
                    while now - h[0][0] > WINDOW_S:
                        h.popleft()
                    if h[-1][1] - h[0][1] > REPORT_S:
                        log.write(f"{now - start:.1f}s pid {pid} tid {tid} waited {h[-1][1] - h[0][1]:.2f}s "
                                  f"for a CPU in the last {now - h[0][0]:.1f}s\n")
            with open("/proc/loadavg") as fh:
                log.write(f"{now - start:.1f}s load {fh.read().split()[:4]}\n")
            log.flush()
            time.sleep(0.5)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
