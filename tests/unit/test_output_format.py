"""What a user reads (issue 31.7): one rank prefix per log line, ``n/a`` for the bytes of
backends commrt cannot count, a benchmark plot that names its mode."""
import importlib.util
import io
import logging
import threading
from collections import deque

import pytest

from commrt import launch
from commrt.apps import reporter
from commrt.bench import report
from commrt.bench.runner import BenchSpec
from commrt.obs import logfmt


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)


def _pumped(label: str, text: str) -> list[str]:
    out = io.StringIO()
    launch._pump(label, io.BytesIO(text.encode()), out, threading.Lock(), deque(maxlen=10), True)
    return out.getvalue().splitlines()


def test_program_log_and_launcher_give_one_prefix(restore_logging):
    """A program's log line through the launcher's pump carries its rank once; a raw print
    (a traceback, a user's print) gets the launcher's label."""
    buf = io.StringIO()
    logfmt.prefixed("rank 1", stream=buf)
    logging.getLogger("commrt.somewhere").info("backend %s", "zmq")
    lines = _pumped("rank 1", buf.getvalue() + "Traceback (most recent call last):\n")
    assert lines == ["[rank 1] backend zmq", "[rank 1] Traceback (most recent call last):"]


def test_launcher_labels_a_line_of_another_label():
    """Only the line's own label is left alone: a worker's line under rank 2 keeps both."""
    assert _pumped("rank 2", "[rank 20] x\n[worker 2] y\n") == ["[rank 2] [rank 20] x", "[rank 2] [worker 2] y"]


def test_reporter_writes_the_launchers_label(restore_logging, capsys):
    reporter("t", "rank 0").info("loss %.1f", 1.5)
    assert capsys.readouterr().out == "[rank 0] loss 1.5\n"


TRAFFIC = {"intra_node_bytes": 0, "inter_node_bytes": 0}


def test_bench_bytes_of_torch_backends_are_not_counted():
    text = report.traffic_lines({"zmq": {"intra_node_bytes": 4096, "inter_node_bytes": 0}, "gloo": dict(TRAFFIC),
                                 "nccl+int8": dict(TRAFFIC, quant="quantized: ...")})
    lines = text.splitlines()
    assert lines[0] == "# zmq: sent inside nodes 4096 B, across nodes 0 B"
    assert lines[1] == "# gloo: sent inside nodes n/a, across nodes n/a"
    assert lines[2] == "# nccl+int8: sent inside nodes n/a, across nodes n/a; quantized: ..."
    assert "commrt does not count" in lines[3]
    assert "n/a" not in report.traffic_lines({"zmq": dict(TRAFFIC)})


def _rows(b2b: bool, alone: bool) -> list[dict]:
    rows = []
    for size in (4096, 8192):
        entry = {"size": size, "count": size // 4}
        if b2b:
            entry.update(time_us=10.0, algbw=1.0, busbw=1.0, wrong=0)
        if alone:
            entry["alone"] = {"time_us": 12.0, "p90_us": 13.0, "busbw": 0.8}
        rows.append({"zmq": entry})
    return rows


@pytest.mark.parametrize("mode, b2b, alone, shown", [
    ("back-to-back", True, False, "back-to-back"),
    ("alone", False, True, "op alone"),
    ("both", True, True, "back-to-back (solid) and op alone (dashed)"),
])
def test_plot_title_names_the_mode(mode, b2b, alone, shown):
    spec = BenchSpec("all_reduce", ("zmq",), 4096, 8192, 2, 1, 0, "float32", "sum", mode=mode)
    rows = _rows(b2b, alone)
    got = report.plot_title(spec, 2, report.plot_mode(rows, "zmq"), b2b and alone)
    assert got == f"all_reduce, 2 ranks, float32: {shown}"


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs the plot extra (matplotlib)")
def test_plot_writes_the_png_and_returns_where(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = BenchSpec("all_reduce", ("zmq",), 4096, 8192, 2, 1, 0, "float32", "sum", mode="both")
    where = report.plot("b.png", spec, 2, _rows(True, True))
    assert where == str(tmp_path / "b.png") and (tmp_path / "b.png").stat().st_size > 1000


def test_bench_json_is_strict_json_when_a_figure_is_not_finite(tmp_path):
    """--physical at one rank: the TCP ring ceiling is inf (no link), and json.dump wrote
    'Infinity', which strict JSON parsers (jq, JSON.parse) refuse. Now null; the rest intact."""
    import json
    spec = BenchSpec("all_reduce", ("zmq",), 4096, 4096, 2, 1, 0, "float32", "sum", physical=True,
                     mode="back-to-back")
    row = {"zmq": {"size": 4096, "count": 1024, "time_us": 10.0, "algbw": 0.4, "busbw": 0.0, "wrong": 0,
                   "path": "shm"}, "ceiling": float("inf"),
           "memory": {"memcpy": 5.0, "reduce": 4.0, "busbw": float("nan")}}
    path = tmp_path / "b.json"
    report.write_json(str(path), report.to_json(spec, 1, [row], "commrt bench all_reduce --physical"))

    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    doc = json.loads(path.read_text(), parse_constant=refuse)
    got = doc["rows"][0]
    assert got["ceiling"] is None and got["memory"] == {"memcpy": 5.0, "reduce": 4.0, "busbw": None}
    assert got["zmq"]["time_us"] == 10.0 and doc["avg_busbw"] == {"zmq": 0.0}


@pytest.mark.parametrize("mode", ["both", "alone", "back-to-back"])
@pytest.mark.parametrize("physical", [False, True])
def test_bench_table_columns_line_up_with_long_backend_names(mode, physical):
    """Every header line and every row is one run of right-aligned columns, so they end at the
    same place: with --physical and an --algo column ('eff:zmq:recursive_doubling') the header
    was 16 characters longer than the rows."""
    names = ("zmq", "zmq:recursive_doubling")
    spec = BenchSpec("all_reduce", names, 4096, 4096, 2, 1, 0, "float32", "sum", physical, mode)
    one = {"size": 4096, "count": 1024, "wrong": 0, "path": "tcp"}
    if mode != "alone":
        one |= {"time_us": 10.0, "algbw": 0.4, "busbw": 0.2}
    if mode != "back-to-back":
        one["alone"] = {"time_us": 9.0, "p90_us": 11.0, "busbw": 0.3}
    row = {n: dict(one) for n in names} | {"ceiling": 1.0, "memory": {"memcpy": 1.0, "reduce": 1.0, "busbw": 1.0}}
    lines = report.table(spec, 2, [row]).splitlines()
    head2, head3, data = lines[3], lines[4], lines[5]
    assert head2.startswith("#  ") and data.startswith("  ")
    assert len(head2) == len(head3) == len(data)
