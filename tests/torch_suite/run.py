"""Run PyTorch's distributed test suite (or a named subset) for commrt and gloo in one session
and write a pass/fail/skip table (docs/TORCH_SUITE.md).

    PYTHONPATH=$PWD python -m tests.torch_suite.run [--world 2] [--timeout 120] [--all | TEST ...]

Each backend runs in its own interpreter (tests/torch_suite/suite_main.py) with BACKEND,
WORLD_SIZE, TEMP_DIR set as test_distributed_spawn does; every test spawns WORLD_SIZE ranks and
is bounded by the suite's own per-test timeout (DISTRIBUTED_TESTS_DEFAULT_TIMEOUT).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

# one or more tests for every operation the backend serves (--all: 285 tests, 15-25 minutes a backend here)
SUBSET = [
    "test_all_reduce_sum", "test_all_reduce_sum_async", "test_all_reduce_max", "test_all_reduce_product",
    "test_all_reduce_coalesced_sum", "test_broadcast", "test_reduce_sum", "test_all_gather",
    "test_all_gather_coalesced_simple", "test_gather", "test_scatter", "test_all_to_all",
    "test_all_to_all_single_unequal_split", "test_send_recv", "test_send_recv_with_tag", "test_isend",
    "test_irecv", "test_send_recv_any_source", "test_batch_isend_irecv_gloo", "test_barrier",
    "test_monitored_barrier_gloo", "test_DistributedDataParallelCPU",
]
HERE = os.path.dirname(os.path.abspath(__file__))


def run_backend(backend: str, tests: list[str], world: int, timeout_s: int) -> tuple[dict, float]:
    """``backend`` "commrt@gloo": commrt running the tests the suite selects for gloo."""
    backend, _, select = backend.partition("@")
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "BACKEND": select or backend, "WORLD_SIZE": str(world), "TEMP_DIR": tmp,
               "SUITE_RUN_BACKEND": backend if select else "",
               "DISTRIBUTED_TESTS_DEFAULT_TIMEOUT": str(timeout_s),
               "TORCH_SUITE_RESULTS": os.path.join(tmp, "results.json")}
        names = [f"TestDistBackendWithSpawn.{t}" for t in tests]
        log_dir = os.environ.get("TORCH_SUITE_LOG_DIR") or tmp  # the whole output, for reading failures
        log = os.path.join(log_dir, f"{backend}-{select}.log")
        start = time.monotonic()
        with open(log, "w") as out:
            try:
                subprocess.run([sys.executable, os.path.join(HERE, "suite_main.py"), "-v", *names], env=env,
                               stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s * max(1, len(tests)) + 600)
            except subprocess.TimeoutExpired:  # what finished is in the results file; the rest is "not run"
                pass
        try:
            with open(env["TORCH_SUITE_RESULTS"]) as f:
                results = json.load(f)
        except FileNotFoundError:  # the run died before its first verdict
            results = {}
    for t in tests:
        results.setdefault(t, "not run")
    return results, time.monotonic() - start


def table(runs: dict, world: int, which: str) -> str:
    backends = list(runs)
    lines = [f"World size {world}; {which or 'the subset in tests/torch_suite/run.py'}.", "",
             "| backend | pass | fail | skip | not run | minutes |", "|---|---|---|---|---|---|"]
    for b, (res, secs) in runs.items():
        count = lambda k: sum(v.split(":")[0] == k for v in res.values())
        lines.append(f"| {b} | {count('pass')} | {count('fail')} | {count('skip')} | {count('not run')} | {secs / 60:.1f} |")
    lines += ["", "| test | " + " | ".join(backends) + " |", "|---|" + "---|" * len(backends)]
    for t in sorted(next(iter(runs.values()))[0]):
        lines.append(f"| {t} | " + " | ".join(runs[b][0].get(t, "-") for b in backends) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tests", nargs="*")
    ap.add_argument("--all", action="store_true", help="every test of the suite (285; 15-25 minutes a backend on 2 cores)")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=120, help="seconds per test")
    ap.add_argument("--backends", default="commrt,gloo",
                    help="comma-separated; commrt@gloo runs commrt on the tests selected for gloo")
    ap.add_argument("--out", default="", help="write the table here")
    args = ap.parse_args()
    tests = args.tests or SUBSET
    if args.all:
        for k, v in {"BACKEND": "gloo", "WORLD_SIZE": str(args.world), "TEMP_DIR": "/nonexistent"}.items():
            os.environ.setdefault(k, v)  # read at import by the suite's module; the runs set their own
        from torch.testing._internal.distributed.distributed_test import DistributedTest
        tests = sorted(n for n in dir(DistributedTest._DistTestBase) if n.startswith("test_"))
    runs = {b: run_backend(b, tests, args.world, args.timeout) for b in args.backends.split(",")}
    text = table(runs, args.world, "every test" if args.all else ("the named tests" if args.tests else ""))
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
