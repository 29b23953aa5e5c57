"""``commrt estimate`` against the real thing: train_lm on 4 ranks laid out as 2 nodes x 2
(forced by the launcher), every case's memory_report() and the bytes the transport counted per
step (comm_stats()["by_op"], inside / across nodes, mean over the ranks) next to the pure
model's prediction (programs/estimate_job.py). small_bytes is lowered so that the tiny model
takes the direct, ring and hierarchical paths alike."""
from __future__ import annotations

import io
import json
import os
import sys

import pytest

from commrt.launch import Nodes, launch
from commrt.plan.estimate import Cluster, Job, estimate
from tests.multirank.harness import ROOT
from tests.multirank.programs.estimate_job import CASES

SMALL = 2048
FAST = ["stage0", "stage1", "stage2", "stage3", "hpZ", "HYBRID_SHARD", "qwZ+qgZ"]
SLOW = ["_HYBRID_SHARD_ZERO2", "qgZ stage1", "hpZ+qwZ bf16", "stage2 bf16"]


def run_cases(tmp_path, cases: list[str], nodes: Nodes, timeout_s: float = 240, port: int | None = None) -> None:
    out = io.StringIO()
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "COMMRT_COMM_TIMEOUT_S": "60", "COMMRT_COMM_BACKEND": "zmq", "COMMRT_COMM_SMALL_BYTES": str(SMALL),
           "COMMRT_COMM_HIERARCHICAL": "always"}  # auto would time both paths: the model cannot know its choice
    cmd = [sys.executable, "-m", "tests.multirank.programs.estimate_job", str(tmp_path), *cases]
    result = launch(2, cmd, out=out, timeout_s=timeout_s, env=env, nodes=nodes, port=port)
    assert result.returncode == 0, f"{result.describe()}\n{out.getvalue()[-6000:]}"


def job_of(case: str, units: list[int]) -> Job:
    z, bf16 = CASES[case]["zero_optimization"], CASES[case].get("bf16", {}).get("enabled", False)
    return Job(params=sum(units), stage=z.get("stage"), strategy=z.get("sharding_strategy"),
               hpz=z.get("zero_hpz_partition_size", 1), dtype="bf16" if bf16 else "fp32", units=tuple(units),
               quant_weights="int8" if z.get("zero_quantized_weights") else None,
               quant_grads="int4" if z.get("zero_quantized_gradients") else None)


def check(tmp_path, case: str) -> None:
    runs = [json.loads((tmp_path / f"{case}.{r}.json").read_text()) for r in range(4)]
    est = estimate(job_of(case, runs[0]["units"]), Cluster(nodes=2, per_node=2, small_bytes=SMALL, hierarchical="always"))
    assert list(est.plan) == runs[0]["plan"], case
    for r in runs:
        measured = {k: v for k, v in r["memory"].items() if k != "gathered_peak"}
        assert measured == est.memory, (case, measured, est.memory)
    ops = {op for r in runs for op, v in r["per_step_by_op"].items() if any(v.values())} | set(est.by_op)
    for op in ops:
        got = [sum(r["per_step_by_op"].get(op, {}).get(k, 0) for r in runs) / len(runs)
               for k in ("intra_node_bytes", "inter_node_bytes")]
        want = est.by_op.get(op, (0.0, 0.0))
        for g, w, where in zip(got, want, ("inside nodes", "across nodes")):
            assert abs(g - w) <= 0.05 * max(g, w), f"{case}: {op} {where}: measured {g:.0f} B, predicted {w:.0f} B"
    assert sum(sum(v) for v in est.by_op.values()) > 0


def test_predicted_bytes_and_memory_equal_train_lm(tmp_path):
    run_cases(tmp_path, FAST, Nodes(2, None))
    for case in FAST:
        check(tmp_path, case)


@pytest.mark.slow
def test_predicted_bytes_more_layouts(tmp_path):
    run_cases(tmp_path, SLOW, Nodes(2, None))
    for case in SLOW:
        check(tmp_path, case)


@pytest.mark.slow
def test_predicted_bytes_on_the_emulated_cluster(tmp_path):
    """Two network namespaces (commrt launch --emulate-network; root only): the nodes are told
    apart by address, not by the launcher's variables."""
    from commrt import emulate
    from commrt.runtime.errors import ConfigError
    try:
        emulate.check_usable(emulate.parse_shape("1gbit"))
    except ConfigError as exc:
        pytest.skip(str(exc))
    with emulate.cluster(2, emulate.parse_shape("1gbit")) as net:
        run_cases(tmp_path, FAST, Nodes(2, None, emulate.node_address(0), net.wrap), timeout_s=500, port=29500)
    for case in FAST:
        check(tmp_path, case)
