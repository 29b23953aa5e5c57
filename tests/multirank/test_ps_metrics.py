"""The parameter server's Prometheus page, scraped over loopback during a real SSP run and
compared with ``commrt server-status`` and with what the workers did
(programs/ps_metrics_job.py)."""
from __future__ import annotations

import io
import os
import sys

import pytest

from commrt.launch import free_port, launch
from commrt.transport.security import SECRET_ENV, new_secret
from tests.multirank.harness import ROOT


@pytest.fixture(autouse=True)
def own_secret(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv(SECRET_ENV, new_secret())


def test_metrics_page_matches_server_status_during_a_run():
    """The server gets the port from ``commrt server --metrics-port`` alone; the workers are
    told where to scrape by a variable of the test's own."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "COMMRT_PS_MODE": "ssp", "COMMRT_PS_STALENESS": "1", "COMMRT_PS_LR": "0.05", "COMMRT_PS_TIMEOUT_S": "20",
           "COMMRT_TEST_METRICS_PORT": str(port)}
    text = io.StringIO()
    result = launch(2, [sys.executable, "-m", "tests.multirank.programs.ps_metrics_job", "8"], out=text,
                    timeout_s=90, env=env, servers=1, server_args=["--metrics-port", str(port)])
    out = text.getvalue()
    assert result.returncode == 0, f"{result.describe()}\n{out[-6000:]}"
    assert out.count("METRICS OK") == 1, out[-4000:]
    assert "metrics on http://127.0.0.1:" in out, out[-4000:]
