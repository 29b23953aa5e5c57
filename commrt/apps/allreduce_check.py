"""The quick-start job: check every collective against a locally computed reference, then
print an nccl-tests-style all_reduce bandwidth table. Run it under a launcher:

    commrt launch -n 4 -- python -m commrt.apps.allreduce_check
    commrt launch -n 4 -- python -m workers.allreduce_check        # the same, from the repository root
"""
from __future__ import annotations

import argparse
import sys

import torch

import commrt
from commrt.bench import metrics, report
from commrt.bench.runner import BenchSpec, measure

CHECKS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all", "sendrecv")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-e", "--maxbytes", default="16M")
    p.add_argument("-n", "--iters", type=int, default=10)
    args = p.parse_args(argv)
    commrt.init_process_group()
    rank, n, backend = commrt.get_rank(), commrt.get_world_size(), commrt.get_backend()
    be = commrt.get_world_group().backend
    wrong = cases = 0
    for coll in CHECKS:
        for dtype in (torch.float32, torch.bfloat16, torch.int32):
            for nbytes in (4, 4100, 3 << 20):
                wrong += measure(coll, be, nbytes, dtype, commrt.ReduceOp.SUM, iters=1, warmup=0)["wrong"]
                cases += 1
    if rank == 0:
        verdict = "all correct" if not wrong else f"{wrong} WRONG ELEMENTS"
        print(f"{n} ranks on {backend}: checked {cases} cases of {len(CHECKS)} collectives: {verdict}")
    spec = BenchSpec("all_reduce", (backend,), 4096, metrics.parse_size(args.maxbytes), 4, args.iters, 2,
                     "float32", "sum")
    rows = [{backend: measure("all_reduce", be, s, torch.float32, commrt.ReduceOp.SUM, spec.iters, spec.warmup)}
            for s in metrics.size_series(spec.min_bytes, spec.max_bytes, spec.factor)]
    if rank == 0:
        print(report.table(spec, n, rows), flush=True)
    commrt.destroy_process_group()
    return 1 if wrong or any(r[backend]["wrong"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
