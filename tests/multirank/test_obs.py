"""The comms log counts what a program issued, on every backend; the trace opens as one file;
the flight records of the fault-injection programs name the right rank and op."""
import json
import re
import subprocess
import sys

import pytest

from commrt.obs import analyze, flight, trace
from tests.multirank.harness import ROOT, run_ranks

ENV = {"COMMRT_COMM_TIMEOUT_S": "30"}


def _expected(rank: int, world: int) -> dict:
    """(op, group) -> (count, bytes): what programs/obs_job.py issues on this rank."""
    out = {("all_reduce", 0): (3, 12000), ("all_gather_into_tensor", 0): (2, 2 * 1024 * world),
           ("broadcast", 0): (1, 80), ("barrier", 0): (1, 0)}
    if rank < 2:
        out[("all_reduce", 1)] = (1, 40)
        out[("send" if rank == 0 else "recv", 1)] = (1, 28)
    return out


@pytest.mark.parametrize("backend,nproc", [("zmq", 2), pytest.param("zmq", 3, marks=pytest.mark.slow),
                                            pytest.param("gloo", 2, marks=pytest.mark.slow)])
def test_comms_summary_counts_what_was_issued(backend, nproc, tmp_path):
    env = {**ENV, "COMMRT_COMM_BACKEND": backend, "COMMRT_LOG_COMMS": "1",
           "COMMRT_LOG_TRACE_FILE": str(tmp_path / "trace.json")}
    _, out = run_ranks(nproc, "obs_job", env=env, timeout_s=90)
    summaries = {int(r): json.loads(s) for r, s in re.findall(r"\[rank (\d+)\] SUMMARY (.*)", out)}
    assert sorted(summaries) == list(range(nproc)), out
    for rank, rows in summaries.items():
        got = {}
        for row in rows:
            count, nbytes = got.get((row["op"], row["group"]), (0, 0))
            got[(row["op"], row["group"])] = (count + row["count"], nbytes + row["bytes"])
            assert row["backend"] == backend and row["busbw_gbps"] >= 0
        assert got == _expected(rank, nproc), (rank, rows)
    assert "comms summary (rank 0)" in out and "busbw GB/s" in out
    merged = tmp_path / "merged.json"
    subprocess.run([sys.executable, "-m", "commrt.cli", "trace-merge", str(merged), str(tmp_path / "trace.json")],
                   check=True, cwd=ROOT, timeout=60, capture_output=True)
    events = json.loads(merged.read_text())["traceEvents"]
    assert all(all(k in e for k in trace.REQUIRED) for e in events)
    ops = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in ops} == set(range(nproc))
    assert len([e for e in ops if e["pid"] == 0]) == sum(c for c, _ in _expected(0, nproc).values())


# (mode of programs/failures.py, ranks, the rank and op the flight record must blame, finding kind)
FAULTS = [("dead", 2, 1, "all_reduce", "absent"),  # the last rank exits between two all_reduces
          pytest.param("dead", 3, 2, "all_reduce", "absent", marks=pytest.mark.slow),
          pytest.param("skip", 3, 0, "all_reduce", "absent", marks=pytest.mark.slow),  # rank 0 skips one, leaves
          ("count", 3, 0, "all_reduce", "mismatch")]  # rank 0 all_reduces 101 elements, the others 100


@pytest.mark.parametrize("mode,nproc,rank,op,kind", FAULTS)
def test_flight_record_names_the_rank_and_op(mode, nproc, rank, op, kind, tmp_path):
    env = {**ENV, "COMMRT_COMM_BACKEND": "zmq", "COMMRT_LOG_FLIGHT_DIR": str(tmp_path)}
    run_ranks(nproc, "failures", mode, env=env, timeout_s=60, expect_fail=mode == "skip", stop_on_failure=False)
    findings, lines = analyze.analyze(flight.read_dumps(str(tmp_path)), nproc)
    assert [(f.kind, f.rank, f.op) for f in findings] == [(kind, rank, op)], "\n".join(lines)
    proc = subprocess.run([sys.executable, "-m", "commrt.cli", "flight-record", str(tmp_path)], cwd=ROOT,
                          timeout=60, capture_output=True, text=True)
    assert proc.returncode == 0 and f"rank {rank} " in proc.stdout, proc.stdout + proc.stderr
