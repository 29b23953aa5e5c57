"""Soak (slow, not in the default run: ``pytest -m slow``): rounds of random crashes — a random
rank, step and way of dying — each followed by a group restart from the checkpoint; every round
must end with the uninterrupted result and leave no process behind."""
import io
import os
import random
import sys
import time

import pytest

from commrt.launch import launch
from tests.multirank.harness import ROOT

ROUNDS, BUDGET_S = 8, 400


@pytest.mark.slow
@pytest.mark.timeout(BUDGET_S + 60)
def test_random_kills_and_restarts(tmp_path):
    rng = random.Random(int(os.environ.get("COMMRT_SOAK_SEED", "7")))
    start = time.monotonic()
    for round_ in range(ROUNDS):
        if time.monotonic() - start > BUDGET_S:
            break
        nproc = rng.choice([2, 3, 4])
        fail = f"{rng.randrange(nproc)}:{rng.randrange(10)}:{rng.choice(['exit3', 'sigkill', 'sigterm', 'abort'])}"
        work = tmp_path / f"round{round_}"
        work.mkdir()
        out = io.StringIO()
        env = {**os.environ, "PYTHONPATH": ROOT, "COMMRT_COMM_BACKEND": "zmq", "COMMRT_COMM_TIMEOUT_S": "3",
               "COMMRT_COMM_HEARTBEAT_S": "0.2", "COMMRT_TEST_FAIL": fail}
        result = launch(nproc, [sys.executable, "-m", "tests.multirank.programs.restart_job", str(work)],
                        out=out, env=env, timeout_s=60, max_restarts=1)
        text = out.getvalue()
        assert result.returncode == 0 and len(result.failures) == 1, f"{fail}\n{text}"
        expected = sum(nproc * step + nproc * (nproc - 1) // 2 for step in range(10))
        assert text.count(f"FINAL {float(expected)}") == nproc, f"{fail}\n{text}"
        for pid in result.pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
