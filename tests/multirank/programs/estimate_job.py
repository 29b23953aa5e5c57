"""Run ``commrt.apps.train_lm`` once per case in the same ranks (re-initialising the process
group each time), each writing its memory report and per-step bytes for test_estimate.py.

    estimate_job OUT_DIR CASE [CASE ...]     (CASE names are keys of CASES)
"""
from __future__ import annotations

import json
import os
import sys

from commrt.apps import train_lm

DIMS = ["--steps", "3", "--batch", "2", "--seq", "8", "--vocab", "64", "--dim", "16", "--layers", "1",
        "--heads", "2", "--log-every", "100"]
CASES = {  # name -> [train] table (DeepSpeed keys)
    "stage0": {"zero_optimization": {"stage": 0}},
    "stage1": {"zero_optimization": {"stage": 1}},
    "stage2": {"zero_optimization": {"stage": 2, "reduce_bucket_size": 2000}},
    "stage3": {"zero_optimization": {"stage": 3}},
    "hpZ": {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}},
    "HYBRID_SHARD": {"zero_optimization": {"sharding_strategy": "HYBRID_SHARD"}},
    "_HYBRID_SHARD_ZERO2": {"zero_optimization": {"sharding_strategy": "_HYBRID_SHARD_ZERO2"}},
    "qwZ+qgZ": {"zero_optimization": {"stage": 3, "zero_quantized_weights": True, "zero_quantized_gradients": True}},
    "qgZ stage1": {"zero_optimization": {"stage": 1, "zero_quantized_gradients": True}},
    "hpZ+qwZ bf16": {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2, "zero_quantized_weights": True},
                     "bf16": {"enabled": True}},
    "stage2 bf16": {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}},
}


def _toml(table: dict, prefix: str = "train") -> str:
    lines, subs = [f"[{prefix}]"], []
    for k, v in table.items():
        if isinstance(v, dict):
            subs.append(_toml(v, f"{prefix}.{k}"))
        else:
            lines.append(f"{k} = {json.dumps(v)}")
    return "\n".join(lines + subs) + "\n"


def main() -> int:
    out, cases, rank = sys.argv[1], sys.argv[2:], os.environ["RANK"]
    for case in cases:
        path = os.path.join(out, f"{case}.{rank}.toml")
        with open(path, "w") as fh:
            fh.write(_toml(CASES[case]))
        os.environ["COMMRT_CONFIG"] = path
        assert train_lm.main([*DIMS, "--stats-json", os.path.join(out, case)]) == 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
