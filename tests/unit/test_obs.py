"""The comms log, the trace format, the flight recorder and its analysis, without processes."""
import json
import os
import signal
import types

import pytest
import torch

from commrt.bench.metrics import bus_factor
from commrt.runtime.config import ConfigError, load_config
from commrt.runtime.errors import PeerLost
from commrt.obs import analyze, comms, flight, trace
from commrt.obs.observer import Observer
from commrt.runtime.work import Executor, Work


def test_bucket_is_the_power_of_two_at_or_above():
    assert [comms.bucket(n) for n in (0, 1, 2, 3, 4, 4095, 4096, 4097)] == [0, 1, 2, 4, 4, 4096, 4096, 8192]


def test_percentile_nearest_rank():
    values = [float(i) for i in range(1, 101)]
    assert comms.percentile(values, 50) == 50.0 and comms.percentile(values, 99) == 99.0
    assert comms.percentile([7.0], 99) == 7.0 and comms.percentile([], 50) == 0.0


def test_summary_counts_bytes_and_nccl_tests_bandwidths():
    log = comms.CommsLog()
    for _ in range(4):
        log.add("all_reduce", 4096, 0, "zmq", 4, 0.001)
    log.add("all_reduce", 3000, 0, "zmq", 4, 0.002)  # same bucket (4 KiB)
    log.add("all_gather_into_tensor", 1 << 20, 1, "gloo", 2, 0.01)
    log.add("barrier", 0, 0, "zmq", 4, 0.001)
    rows = {(r["op"], r["bucket"]): r for r in log.rows()}
    ar = rows[("all_reduce", 4096)]
    assert (ar["count"], ar["bytes"], ar["group_size"]) == (5, 4 * 4096 + 3000, 4)
    assert ar["algbw_gbps"] == pytest.approx(ar["bytes"] / 0.006 / 1e9)
    assert ar["busbw_gbps"] == pytest.approx(ar["algbw_gbps"] * bus_factor("all_reduce", 4))  # 2(n-1)/n
    assert ar["p50_us"] == pytest.approx(1000) and ar["p99_us"] == pytest.approx(2000)
    ag = rows[("all_gather_into_tensor", 1 << 20)]
    assert ag["busbw_gbps"] == pytest.approx(ag["algbw_gbps"] * 0.5)  # (n-1)/n at n=2
    assert rows[("barrier", 0)]["busbw_gbps"] == 0.0
    text = comms.format_table(log.rows())
    assert "all_reduce" in text and "busbw GB/s" in text and "4 KiB" in text


def test_log_config_section_env_and_errors(tmp_path):
    cfg = load_config(None, environ={"COMMRT_LOG_COMMS": "1", "COMMRT_LOG_TRACE_FILE": "/x/t.json",
                                     "COMMRT_LOG_FLIGHT_DIR": "/x/f", "COMMRT_LOG_FLIGHT_ENTRIES": "8"})
    assert (cfg.log.comms, cfg.log.trace_file, cfg.log.flight_dir, cfg.log.flight_entries) == (True, "/x/t.json", "/x/f", 8)
    assert load_config(None, environ={}).log.comms is False
    for env in ({"COMMRT_LOG_COMMS": "perhaps"}, {"COMMRT_LOG_FLIGHT_ENTRIES": "0"},
                {"COMMRT_LOG_FLIGHT_ENTRIES": "many"}):
        with pytest.raises(ConfigError, match=r"\[log\]"):
            load_config(None, environ=env)
    path = tmp_path / "c.toml"
    path.write_text("[log]\ncomms = true\nflight_entries = 3\n")
    assert load_config(path, environ={}).log.flight_entries == 3


class _Obs:
    def __init__(self):
        self.seen = []

    def completed(self, rec, error):
        self.seen.append((rec.seq, error))

    def dump(self, reason):
        self.seen.append(reason)


def test_ring_buffer_keeps_the_last_entries_in_order_and_numbers_p2p_apart():
    ring = flight.GroupRing(_Obs(), 3, (0, 1), 0, "zmq", size=4)
    for i in range(6):
        ring.add(False, "all_reduce", 4 * i, torch.float32, -1, flight.STARTED).done(None)
    sent = ring.add(True, "send", 40, torch.float32, 1, flight.QUEUED)
    assert [r.seq for r in ring.entries()] == [4, 5, 6, 1]
    assert (ring.seq, ring.p2p_seq, sent.state) == (6, 1, flight.QUEUED)
    d = ring.as_dict(0.0)
    assert d["last_seq"] == 6 and d["entries"][-1]["kind"] == "p2p" and d["entries"][-1]["peer"] == 1
    assert d["entries"][0]["state"] == flight.COMPLETED and d["entries"][0]["dtype"] == "float32"


def test_a_record_ends_once_and_work_tells_it():
    obs = _Obs()
    ring = flight.GroupRing(obs, 0, (0, 1), 0, "zmq", size=2)
    rec = ring.add(False, "all_reduce", 8, torch.float32, -1, flight.QUEUED)
    ex = Executor("t")
    gate = __import__("threading").Event()
    work = ex.submit("all_reduce", gate.wait)
    work._flight = rec
    gate.set()
    work.wait(30)
    Observer.issued(rec, work)  # registration after completion must not count it twice
    ex.close()
    assert obs.seen == [(1, None)] and rec.state == flight.COMPLETED
    failed = ring.add(False, "all_reduce", 8, torch.float32, -1, flight.QUEUED)
    w = Work("all_reduce")
    Observer.issued(failed, w)
    w._finish(None, PeerLost(1, "all_reduce", 2, "gone"))
    assert failed.state == flight.FAILED and "PeerLost" in failed.error


def test_trace_paths_events_and_merge(tmp_path):
    assert trace.rank_path("/t/run-{rank}.json", 3) == "/t/run-3.json"
    assert trace.rank_path("/t/run.json", 3) == "/t/run.rank3.json"
    template = str(tmp_path / "tr2026.json")
    for rank in (0, 1, 10):
        ev = trace.complete_event("all_reduce", rank, 0, 1e15, 12.5, {"seq": 1})
        trace.write(trace.rank_path(template, rank), trace.track_names(rank, {0: "group 0"}) + [ev])
    files = trace.rank_files([template])
    assert [os.path.basename(f) for f in files] == ["tr2026.rank0.json", "tr2026.rank1.json", "tr2026.rank10.json"]
    merged = tmp_path / "all.json"
    trace.write(str(merged), trace.merge(files))
    events = json.loads(merged.read_text())["traceEvents"]
    assert all(all(k in e for k in trace.REQUIRED) for e in events)
    complete = [e for e in events if e["ph"] == "X"]
    assert sorted(e["pid"] for e in complete) == [0, 1, 10] and all(e["dur"] == 12.5 for e in complete)


def _group(gid=0, ranks=(0, 1), rank=0):
    return types.SimpleNamespace(group_id=gid, ranks=ranks, rank=rank, backend=types.SimpleNamespace(name="zmq"))


def test_observer_dumps_on_typed_errors_and_sigusr1(tmp_path):
    cfg = load_config(None, environ={"COMMRT_LOG_FLIGHT_DIR": str(tmp_path), "COMMRT_LOG_COMMS": "1"})
    obs = Observer(cfg, 1, 2)
    try:
        g = _group(rank=1)
        for _ in range(3):
            obs.issued(obs.begin(g, "all_reduce", 400, torch.float32), None)
        assert obs.summary()[0]["count"] == 3 and obs.summary()[0]["bytes"] == 1200
        assert not os.listdir(tmp_path)
        obs.begin(g, "all_reduce", 400, torch.float32).done(PeerLost(0, "all_reduce", 4, "gone"))
        (dump,) = flight.read_dumps(str(tmp_path))
        assert dump["rank"] == 1 and "PeerLost" in dump["reason"] and dump["groups"][0]["last_seq"] == 4
        os.remove(tmp_path / "rank1.json")
        assert signal.getsignal(signal.SIGUSR1) == obs._on_signal  # no handler of the program's own
        os.kill(os.getpid(), signal.SIGUSR1)
        assert flight.read_dumps(str(tmp_path))[0]["reason"] == "SIGUSR1"
    finally:
        obs.close()
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL  # given back


def _dump(rank, entries, world=3, gid=0, ranks=(0, 1, 2)):
    colls = [e for e in entries if e.get("kind", "coll") == "coll"]
    full = [{"kind": "coll", "peer": -1, "dtype": "float32", "state": "completed", "error": None, **e} for e in entries]
    return {"version": 1, "rank": rank, "world_size": world, "groups": [
        {"id": gid, "ranks": list(ranks), "rank": rank, "backend": "zmq",
         "last_seq": max((e["seq"] for e in colls), default=0), "last_p2p_seq": 0, "entries": full}]}


def test_analysis_names_the_absent_rank():
    ops = [{"seq": 1, "op": "all_reduce", "nbytes": 40}, {"seq": 2, "op": "all_gather_into_tensor", "nbytes": 96, "state": "failed"}]
    findings, lines = analyze.analyze([_dump(0, ops), _dump(1, ops)])
    assert [(f.kind, f.rank, f.seq, f.op) for f in findings] == [("absent", 2, 2, "all_gather_into_tensor")]
    assert any("no record from ranks [2]" in line for line in lines)


def test_analysis_names_the_rank_that_stopped_early():
    ops = [{"seq": s, "op": "broadcast", "nbytes": 8} for s in (1, 2, 3)]
    findings, _ = analyze.analyze([_dump(0, ops), _dump(1, ops[:2]), _dump(2, ops)])
    assert [(f.kind, f.rank, f.seq, f.op) for f in findings] == [("behind", 1, 3, "broadcast")]


def test_analysis_names_the_minority_in_a_mismatch_and_both_in_a_tie():
    good = [{"seq": 1, "op": "all_reduce", "nbytes": 400}]
    bad = [{"seq": 1, "op": "all_reduce", "nbytes": 404}]
    findings, _ = analyze.analyze([_dump(0, bad), _dump(1, good), _dump(2, good)])
    assert [(f.kind, f.rank, f.op) for f in findings] == [("mismatch", 0, "all_reduce")]
    findings, _ = analyze.analyze([_dump(0, bad, 2, ranks=(0, 1)), _dump(1, good, 2, ranks=(0, 1))])
    assert sorted(f.rank for f in findings) == [0, 1]
    findings, lines = analyze.analyze([_dump(r, good) for r in range(3)])
    assert findings == [] and "no rank is missing" in lines[-1]


def test_verbose_logs_one_json_line_per_op(caplog):
    cfg = load_config(None, environ={"COMMRT_LOG_COMMS": "1", "COMMRT_LOG_VERBOSE": "1"})
    obs = Observer(cfg, 0, 2)
    try:
        with caplog.at_level("INFO", logger="commrt.obs"):
            obs.issued(obs.begin(_group(), "broadcast", 80, torch.float64), None)
        (line,) = [json.loads(r.getMessage()) for r in caplog.records if r.getMessage().startswith("{")]
        assert (line["op"], line["nbytes"], line["dtype"], line["state"], line["seq"]) == \
            ("broadcast", 80, "float64", "completed", 1)
    finally:
        obs.close()


@pytest.mark.parametrize("record", [
    {"version": 1, "groups": []},  # no rank
    {"version": 1, "rank": 0, "groups": [{"id": 0}]},  # a group without its members and entries
    {"version": 1, "rank": 0, "groups": [{"id": 0, "ranks": [0], "last_seq": 1, "entries": [{"seq": 1}]}]},
])
def test_an_incomplete_flight_record_is_named_not_a_keyerror(tmp_path, record):
    """Found in the hardening review (wtT4): read_dumps checked the version only, and
    `commrt flight-record` then died with a KeyError from inside the analysis."""
    (tmp_path / "rank0.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match="rank0.json: not a complete commrt flight record"):
        flight.read_dumps(str(tmp_path))


def test_trace_merge_of_a_template_in_a_missing_directory_says_so(tmp_path):
    from commrt.cli import main
    with pytest.raises(SystemExit, match="commrt trace-merge: .*No such file"):
        main(["trace-merge", str(tmp_path / "out.json"), str(tmp_path / "nowhere" / "trace.json")])


def test_trace_and_flight_files_are_never_written_through_a_planted_link(tmp_path, monkeypatch):
    """Found in the hardening review (wtT4): the atomic writes opened a predictable temporary name
    (path.tmp<pid>[.<n>]) with open(..., "w"), which follows a symlink: in a shared directory
    another user could plant one and have the rank overwrite any file of its owner's."""
    import itertools
    victim = tmp_path / "victim"
    victim.write_text("precious")
    path = str(tmp_path / "trace.json")
    os.symlink(victim, f"{path}.tmp{os.getpid()}")
    trace.write(path, [])
    monkeypatch.setattr(flight, "_TMP_IDS", itertools.count())
    os.symlink(victim, f"{flight.dump_path(str(tmp_path), 0)}.tmp{os.getpid()}.0")
    flight.write_dump(str(tmp_path), {"rank": 0, "version": 1, "groups": []})
    assert victim.read_text() == "precious"
    assert not os.path.islink(path) and json.loads(open(path).read())["traceEvents"] == []
    assert not os.path.islink(flight.dump_path(str(tmp_path), 0))



def test_a_failed_trace_or_flight_write_leaves_no_temporary_file(tmp_path):
    """A write that fails part-way (a full disk; EFBIG under RLIMIT_FSIZE here) left the partial
    ``<path>.tmp<pid>...`` behind, one per failed dump, in the directory that was full."""
    import resource
    old_limit, old_handler = resource.getrlimit(resource.RLIMIT_FSIZE), signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, old_limit[1]))
    try:
        with pytest.raises(OSError):
            flight.write_dump(str(tmp_path), {"rank": 0, "version": 1, "groups": [{"pad": "y" * 100_000}]})
        with pytest.raises(OSError):
            trace.write(str(tmp_path / "trace.json"), [{"pad": "z" * 100_000}])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert os.listdir(tmp_path) == []


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_STOPPED_RANK = """
import os, signal, sys, time, types
from commrt.obs.observer import Observer
from commrt.runtime.config import load_config
obs = Observer(load_config(None, environ={"COMMRT_LOG_FLIGHT_DIR": sys.argv[1],
                                          "COMMRT_LOG_TRACE_FILE": sys.argv[1] + "/trace.json"}), 2, 3)
g = types.SimpleNamespace(group_id=0, ranks=(0, 1, 2), rank=2, backend=types.SimpleNamespace(name="zmq"))
obs.issued(obs.begin(g, "all_reduce", 400, "float32"), None)
obs.begin(g, "all_reduce", 400, "float32")  # waiting for a peer that died, when the launcher stops us
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(10)
sys.exit(3)  # not reached: SIGTERM still ends the process
"""


def test_a_rank_stopped_with_sigterm_leaves_its_flight_record(tmp_path):
    """Found in the hardening review (wtT4): `commrt launch` stops the other ranks with SIGTERM
    within milliseconds of one dying, before their heartbeats tell them, so a job whose rank died
    left no flight record at all (the multirank flight tests run with stop_on_failure=False).
    Now the record is written, and the process still ends by SIGTERM."""
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-c", _STOPPED_RANK, str(tmp_path)], timeout=60, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == -signal.SIGTERM, proc.stderr
    (dump,) = flight.read_dumps(str(tmp_path))
    assert dump["rank"] == 2 and dump["reason"].startswith("SIGTERM")
    assert [(e["seq"], e["state"]) for e in dump["groups"][0]["entries"]] == [(1, "completed"), (2, "started")]
    assert [e["args"]["seq"] for e in trace.load(str(tmp_path / "trace.rank2.json")) if e["ph"] == "X"] == [1]


def test_closing_leaves_a_signal_handler_the_program_set_since_alone(tmp_path):
    """Found in the hardening review (wtT4): close() put SIG_DFL back unconditionally, so a
    handler the program installed after init (a checkpoint on SIGUSR1 or SIGTERM) was dropped
    at destroy_process_group."""
    cfg = load_config(None, environ={"COMMRT_LOG_FLIGHT_DIR": str(tmp_path)})
    obs = Observer(cfg, 0, 1)
    mine = lambda signum, frame: None  # noqa: E731
    try:
        assert signal.getsignal(signal.SIGTERM) == obs._on_term
        signal.signal(signal.SIGUSR1, mine)
        obs.close()
        assert signal.getsignal(signal.SIGUSR1) is mine
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # ours: given back
    finally:
        obs.close()
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)


@pytest.mark.parametrize("count", [0, 1, 3, trace.WRITE_CHUNK, trace.WRITE_CHUNK + 1, 2 * trace.WRITE_CHUNK + 5])
def test_trace_written_in_chunks_is_the_whole_document(tmp_path, count):
    """trace.write encodes its events a chunk at a time (json.dumps, C): the file is the one
    document json.dump wrote, across chunk boundaries, and loads back to the same events."""
    events = [{"name": f"op{i}", "ph": "X", "ts": i * 0.5, "dur": 1.25, "pid": 0, "tid": i % 3,
               "args": {"seq": i, "text": "é\n\""}} for i in range(count)]
    trace.write(str(tmp_path / "t.json"), events)
    with open(tmp_path / "t.json") as fh:
        assert json.load(fh) == trace.document(events)
    assert trace.load(str(tmp_path / "t.json")) == events and not list(tmp_path.glob("*.tmp*"))
