"""train_lm, 2 nodes x 2 ranks laid out on one host (loopback): _HYBRID_SHARD_ZERO2 with
fault_tolerance off (the engine's HSDP) vs "replica" (replica groups of 2 through ReplicaFT),
alternating ROUNDS times; prints the slowest rank's median step and rank 0's replica phases.

    PYTHONPATH=. python tests/perf/replica_hsdp_ab.py ROUNDS
"""
import io
import os
import re
import sys

sys.path.insert(0, os.getcwd())
from commrt.launch import Nodes, launch  # noqa: E402

ARGS = ["--dim", "384", "--layers", "4", "--steps", "12", "--log-every", "100"]
CONFIG = '[train]\nfault_tolerance = "{}"\n[train.zero_optimization]\nsharding_strategy = "_HYBRID_SHARD_ZERO2"\n'

for ft in ("off", "replica"):
    with open(f"/tmp/replica_hsdp_ab_{ft}.toml", "w") as fh:
        fh.write(CONFIG.format(ft))
for rnd in range(int(sys.argv[1]) if len(sys.argv) > 1 else 2):
    for ft in ("off", "replica"):
        out = io.StringIO()
        r = launch(2, [sys.executable, "-m", "commrt.apps.train_lm", *ARGS], config=f"/tmp/replica_hsdp_ab_{ft}.toml",
                   out=out, timeout_s=280, nodes=Nodes(2, None, "127.0.0.1", None))
        text = out.getvalue()
        med = [float(x) for x in re.findall(r"median step ([\d.]+) ms", text)]
        phases = re.findall(r"\[rank 0\].*per step \(ms\): (.*)", text)
        print(f"round {rnd} {ft:8s} exit {r.returncode}: slowest median {max(med or [0]):.1f} ms",
              f"(rank 0: {phases[0]})" if phases else "", flush=True)
