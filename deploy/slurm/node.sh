#!/usr/bin/env bash
# One srun task of a commrt job: a worker node (`commrt launch` of its ranks) or one
# parameter-server shard. commrt.sbatch runs it; the mapping of SLURM_* to node rank, master
# address and shard addresses is commrt/deploy/plan.py (slurm_plan), so this stays one line.
#   node.sh worker [--max-restarts K] -- PROGRAM ARGS...
#   node.sh server [--resume]
set -euo pipefail
exec "${COMMRT_PYTHON:-python3}" -m commrt.cli node slurm "$@"
