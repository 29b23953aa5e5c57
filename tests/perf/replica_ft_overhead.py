"""Overhead of fault_tolerance = "replica" on a healthy step: the same program
(tests/multirank/programs/replica_ft_job.py), replica mode vs --off (DataParallel), 3 ranks on
loopback, ROUNDS alternating rounds (off, on, off, on, ...; off first and last), one run each.

    PYTHONPATH=. python tests/perf/replica_ft_overhead.py STEPS WIDTH [ROUNDS] [--no-overlap]

Prints each run's median step time (the slowest rank's median, the first fifth of the steps
dropped as warm-up), the ratio of the replica runs' median to the off runs' median, and where
replica mode's step time goes (copy of the gradients, all-reduce, the vote through the store,
the division and optimizer step), per step, from ``comm_stats()["replica_ft"]["time_s"]``.
"""
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.getcwd())
from commrt.runtime.config import load_config  # noqa: E402
from commrt.train.replica_ft import PHASES, serve  # noqa: E402

steps, width = int(sys.argv[1]), sys.argv[2]
rounds = int(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[3].isdigit() else 3
replica_args = ["--no-overlap"] if "--no-overlap" in sys.argv else []
env = {**os.environ, "PYTHONPATH": os.getcwd()}


def port() -> int:
    from commrt.launch import free_port
    return free_port()


def run(off: bool) -> tuple[float, dict]:
    p = port()
    srv = None if off else serve(load_config(), "127.0.0.1", p)
    ps = [subprocess.Popen([sys.executable, "-m", "tests.multirank.programs.replica_ft_job", str(r), "3",
                            f"127.0.0.1:{p}", str(steps), f"/tmp/replica_ft_ov{os.getpid()}_{r}", "--width", width]
                           + (["--off"] if off else replica_args), env=env, stderr=subprocess.DEVNULL) for r in range(3)]
    for q in ps:
        q.wait(timeout=600)
    if srv:
        srv[1].close()
        srv[0].close()
    per, phases = [], dict.fromkeys(PHASES, 0.0)
    for r in range(3):
        out = json.load(open(f"/tmp/replica_ft_ov{os.getpid()}_{r}.json"))
        t = out["times"]
        per.append(statistics.median([t[k][1] for k in sorted(t, key=int)][steps // 5:]))
        for k, v in (out.get("counts") or {}).get("time_s", {}).items():
            phases[k] += v / 3 / steps
    return max(per), phases


offs, ons, spent = [], [], dict.fromkeys(PHASES, 0.0)
for i in range(2 * rounds + 1):
    if i % 2 == 0:
        offs.append(run(True)[0])
    else:
        t, phases = run(False)
        ons.append(t)
        spent = {k: spent[k] + v / rounds for k, v in phases.items()}
print("off     ms:", " ".join(f"{t * 1e3:.2f}" for t in offs))
print("replica ms:", " ".join(f"{t * 1e3:.2f}" for t in ons))
print(f"ratio (median replica / median off): {statistics.median(ons) / statistics.median(offs):.3f}; "
      f"least disturbed runs (min / min): {min(ons) / min(offs):.3f}")
print("replica step, mean per step (ms): " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in spent.items()))
