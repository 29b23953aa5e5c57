"""The parameter server's Prometheus page, scraped over loopback during a real SSP run and
compared with ``commrt server-status`` and with what the workers did
(programs/ps_metrics_job.py)."""
from __future__ import annotations

import pytest

from commrt.launch import free_port
from commrt.security import SECRET_ENV, new_secret
from tests.multirank.harness import run_ranks


@pytest.fixture(autouse=True)
def own_secret(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv(SECRET_ENV, new_secret())


def test_metrics_page_matches_server_status_during_a_run():
    env = {"COMMRT_PS_MODE": "ssp", "COMMRT_PS_STALENESS": "1", "COMMRT_PS_LR": "0.05",
           "COMMRT_PS_METRICS_PORT": str(free_port()), "COMMRT_PS_TIMEOUT_S": "20"}
    _, out = run_ranks(2, "ps_metrics_job", "8", env=env, servers=1, timeout_s=90)
    assert out.count("METRICS OK") == 1, out[-4000:]
    assert "metrics on http://127.0.0.1:" in out, out[-4000:]
