"""A stand-in for SLURM's ``srun`` inside an emulated cluster, so the sbatch recipe runs as written.

It understands the options commrt.sbatch uses (--nodes, --relative, --ntasks, --ntasks-per-node,
--overlap, --kill-on-bad-exit), starts one task per node in that node's network namespace with
the step variables slurmstepd sets (SLURM_NODEID and SLURM_PROCID relative to the step,
SLURM_NNODES of the step, ...), forwards SIGTERM to its tasks like srun, and with
--kill-on-bad-exit stops the step when one task fails. Nodes: FAKE_SLURM_HOSTS and
FAKE_SLURM_NAMESPACES (comma lists, in allocation order).
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--relative", type=int, default=0)
    p.add_argument("--ntasks", type=int, required=True)
    p.add_argument("--ntasks-per-node", type=int, default=1)
    p.add_argument("--overlap", action="store_true")
    p.add_argument("--kill-on-bad-exit", type=int, default=0)
    args, cmd = p.parse_known_args()
    hosts, spaces = os.environ["FAKE_SLURM_HOSTS"].split(","), os.environ["FAKE_SLURM_NAMESPACES"].split(",")
    nodes = list(range(args.relative, args.relative + args.nodes))
    assert args.ntasks == args.nodes and nodes[-1] < len(hosts), (args, hosts)  # one task per node here
    procs = []
    for k, node in enumerate(nodes):
        env = dict(os.environ, SLURM_NNODES=str(args.nodes), SLURM_NODEID=str(k), SLURM_PROCID=str(k),
                   SLURM_LOCALID="0", SLURM_NTASKS=str(args.ntasks), SLURM_TASKS_PER_NODE=f"1(x{args.nodes})",
                   SLURM_STEP_NODELIST=",".join(hosts[n] for n in nodes), SLURMD_NODENAME=hosts[node])
        procs.append(subprocess.Popen(["ip", "netns", "exec", spaces[node], *cmd], env=env, start_new_session=True))

    def forward(signum, _frame):
        for q in procs:
            if q.poll() is None:
                os.killpg(q.pid, signum)
    signal.signal(signal.SIGTERM, forward)
    while True:
        codes = [q.poll() for q in procs]
        bad = [c for c in codes if c not in (None, 0)]
        if bad and args.kill_on_bad_exit:
            forward(signal.SIGTERM, None)
            for q in procs:
                q.wait()
            return bad[0] if bad[0] > 0 else 128 - bad[0]
        if all(c is not None for c in codes):
            return next((c if c > 0 else 128 - c for c in codes if c), 0)
        time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main())
