"""`commrt bench --mode alone` on real ranks: tiny sizes, both backends, numpy inputs (no timing
assertions: only that every figure is there and every result matched the reference)."""
import json
import os
import subprocess
import sys

from tests.multirank.harness import ROOT


def test_bench_alone_mode_with_numpy_inputs(tmp_path):
    path = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "commrt.cli", "bench", "all_reduce", "--backend", "zmq,gloo",
                           "--nproc", "2", "-b", "1K", "-e", "128K", "-f", "128", "-n", "3", "-w", "1",
                           "--mode", "both", "--input", "numpy", "--physical", "--json", str(path)],
                          env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(path.read_text())
    assert doc["mode"] == "both" and doc["input"] == "numpy"
    assert [r["zmq"]["size"] for r in doc["rows"]] == [1024, 131072]
    for row in doc["rows"]:
        assert row["memory"]["memcpy"] > 0 and row["memory"]["reduce"] > 0 and row["memory"]["busbw"] > 0
        # ours goes through shared memory between ranks of one host ([comm] intra_node = "auto")
        for b, path in (("zmq", "shm"), ("gloo", "tcp")):
            assert row[b]["wrong"] == 0 and row[b]["time_us"] > 0 and row[b]["path"] == path
            assert row[b]["alone"]["samples"] == 3 and row[b]["alone"]["time_us"] > 0
    assert "alone" in proc.stdout and "# Avg bus bw, op by op" in proc.stdout
