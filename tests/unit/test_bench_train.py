"""``commrt bench train`` end to end at one rank (the launcher starts it): every strategy gets a
row, the plain loop is the reference, and the JSON matches the table."""
import json
import os
import subprocess
import sys


def test_one_rank_run_reports_every_strategy(tmp_path):
    out = tmp_path / "train.json"
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    env.pop("RANK", None)
    proc = subprocess.run([sys.executable, "-m", "commrt.cli", "bench", "train", "-n", "1", "--stages", "0,3",
                           "--dim", "32", "--layers", "1", "--seq", "8", "--vocab", "64", "--steps", "3",
                           "--warmup", "1", "--rounds", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["strategy"] for r in rows] == ["plain torch", "commrt stage 0", "commrt stage 3"]
    assert rows[0]["efficiency"] == 1.0 and rows[0]["breakdown_ms"] is None
    for r in rows[1:]:
        assert r["step_ms"] > 0 and r["samples_per_s"] > 0 and r["breakdown_ms"]["total"] > 0
        assert r["strategy"] in proc.stdout
