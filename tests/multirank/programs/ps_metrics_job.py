"""SSP training against one server shard serving metrics (``commrt server --metrics-port``); worker 1 is slow, so
the staleness bound holds worker 0 back. Worker 0 scrapes the metrics page during the run and,
once every worker's last step is applied, compares the page with ``commrt server-status`` and
with what the workers did; it prints 'METRICS OK' and both views as JSON.

    ps_metrics_job STEPS
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time
import urllib.request

import torch
from prometheus_client.parser import text_string_to_metric_families

from commrt import cli
from commrt.runtime.config import load_config
from commrt.ps import PSClient
from tests.multirank.programs.ps_job import batch, grads_of, make_params


def scrape(port: int) -> dict:
    """{(sample name, labels as a sorted tuple): value} from the metrics page."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def server_status() -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["server-status"]) == 0
    (stats,) = json.loads(out.getvalue())  # one shard
    return stats


def check(page: dict, st: dict) -> None:
    """Every server-status number is on the page, the same."""
    srv = (("server", "0"),)
    for key in ("pushes", "pulls", "bytes_in", "bytes_out", "rejected", "duplicates", "malformed", "ssp_waits"):
        assert page[(f"commrt_ps_{key}_total", srv)] == st[key], (key, page, st)
    assert page[("commrt_ps_version", srv)] == st["version"]
    for w, (clock, lag) in enumerate(zip(st["clocks"], st["lag"])):
        labels = (("server", "0"), ("worker", str(w)))
        assert page[("commrt_ps_worker_clock", labels)] == clock and page[("commrt_ps_worker_lag", labels)] == lag
    for gap, n in st["staleness"].items():
        assert page[("commrt_ps_updates_by_staleness_total", (("gap", gap), ("server", "0")))] == n
    assert page[("commrt_ps_segments", srv)] == st["segments"]
    h = st["apply_latency"]
    assert page[("commrt_ps_apply_seconds_count", srv)] == h["count"] == sum(h["counts"])
    assert abs(page[("commrt_ps_apply_seconds_sum", srv)] - h["sum"]) < 1e-9


def wait_for(cond, what: str, deadline_s: float = 30.0):
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise TimeoutError(f"waited {deadline_s}s for {what}")


def main() -> int:
    steps = int(sys.argv[1])
    torch.set_num_threads(1)
    cfg = load_config()
    client = PSClient(cfg)
    worker, workers, port = client.worker, cfg.ps.workers, int(os.environ["COMMRT_TEST_METRICS_PORT"])
    params = make_params()
    client.init(params)
    client.pull(params)
    for step in range(steps):
        if worker == workers - 1:
            time.sleep(0.05)  # the straggler: the others meet the staleness bound
        client.push_pull(grads_of(params, *batch(worker, step)), params)
        if worker == 0 and step == steps // 2:
            mid = scrape(port)  # during the run
            assert mid[("commrt_ps_pushes_total", (("server", "0"),))] >= steps // 2, mid
    if worker == 0:
        # ssp applies each push on its own: one version per worker and step
        done = lambda: (st := server_status())["version"] == workers * steps and st
        st = wait_for(done, "every worker's last step")
        page = scrape(port)
        check(page, st)
        nbytes = sum(v.numel() * 4 for v in params.values())
        assert st["pushes"] == workers * steps and st["pulls"] == workers and st["rejected"] == 0
        # one initial pull and one push_pull reply per step, each worker, every value once
        wait_for(lambda: server_status()["bytes_out"] == workers * (steps + 1) * nbytes, "the last pull replies")
        st = server_status()
        check(scrape(port), st)
        assert st["bytes_in"] > workers * steps * nbytes and st["lag"] == [0] * workers
        assert st["ssp_waits"] > 0 and st["apply_latency"]["count"] == workers * steps
        print("METRICS OK", json.dumps(st), flush=True)
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
