"""A step breakdown's spans reach the Perfetto trace (issue 29.1): StepClock hands every span to
its sink as it closes, nested ones before the phase that holds them, and the observer writes them
on the rank's "train step" track beside the collectives."""
from __future__ import annotations

import json
import time

from commrt.obs import trace
from commrt.obs.observer import Observer
from commrt.runtime.config import load_config
from commrt.train.breakdown import StepClock


def test_every_span_reaches_the_sink_with_its_own_duration():
    seen = []
    clock = StepClock(lambda name, start, seconds: seen.append((name, start, seconds)))
    with clock.span("backward"):
        time.sleep(0.01)
        with clock.span("comm_waited"):
            time.sleep(0.02)
    b = clock.finish_step()
    assert [n for n, _, _ in seen] == ["comm_waited", "backward"]
    (_, s_wait, d_wait), (_, s_back, d_back) = seen
    assert s_back <= s_wait and d_back >= d_wait + 0.009  # the phase holds the wait
    assert abs(b.comm_waited - d_wait) < 1e-6 and abs(b.backward - (d_back - d_wait)) < 1e-6


def test_the_observer_writes_the_spans_on_their_own_track(tmp_path):
    cfg = load_config(None, environ={"COMMRT_LOG_TRACE_FILE": str(tmp_path / "t.json")})
    obs = Observer(cfg, 0, 1)
    clock = StepClock(obs.span)
    with clock.span("forward"):
        pass
    obs.close()
    events = json.load(open(tmp_path / "t.rank0.json"))["traceEvents"]
    spans = [e for e in events if e.get("cat") == "train"]
    assert [(e["name"], e["tid"]) for e in spans] == [("forward", trace.TRAIN_TID)]
    names = [e["args"]["name"] for e in events if e["name"] == "thread_name"]
    assert any(n.startswith("train step") for n in names)
