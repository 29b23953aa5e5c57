"""Review of the observability layer (revB): each test failed before its fix."""
import json
import os
import signal
import subprocess
import sys
import time
import types

import torch

from commrt.obs import analyze, flight, trace
from commrt.obs.observer import Observer
from commrt.runtime.config import load_config


def _dump(rank, entries, world=3, gid=0, ranks=(0, 1, 2)):
    full = [{"kind": "coll", "peer": -1, "dtype": "float32", "state": "completed", "error": None, **e} for e in entries]
    return {"version": 1, "rank": rank, "world_size": world, "groups": [
        {"id": gid, "ranks": list(ranks), "rank": rank, "backend": "zmq",
         "last_seq": max((e["seq"] for e in entries), default=0), "last_p2p_seq": 0, "entries": full}]}


def test_a_rank_two_collectives_behind_is_blamed_for_the_one_it_missed():
    """Async ops let the others issue several collectives past a stuck rank: the finding named
    the newest one (here broadcast, seq 3) as the one rank 1 never entered at seq 2."""
    ops = [{"seq": 1, "op": "all_reduce", "nbytes": 40},
           {"seq": 2, "op": "all_gather_into_tensor", "nbytes": 96, "state": "started"},
           {"seq": 3, "op": "broadcast", "nbytes": 8, "state": "queued"}]
    findings, lines = analyze.analyze([_dump(0, ops), _dump(1, ops[:1]), _dump(2, ops)])
    assert [(f.kind, f.rank, f.seq, f.op) for f in findings] == [("behind", 1, 2, "all_gather_into_tensor")]
    assert "never entered seq 2 (all_gather_into_tensor)" in findings[0].detail, lines


def test_an_uneven_all_to_all_is_not_a_mismatch():
    """all_to_all_single with split sizes (MoE routing) sends a different number of bytes from
    each rank by design: the analysis blamed every rank of it as a mismatch (a tie), beside the
    rank that really was absent. A different op or dtype at that seq is still one."""
    def ops(nbytes, op="all_to_all_single", dtype="float32"):
        return [{"seq": 1, "op": op, "nbytes": nbytes, "dtype": dtype},
                {"seq": 2, "op": "all_reduce", "nbytes": 40, "state": "started"}]
    findings, lines = analyze.analyze([_dump(0, ops(48)), _dump(1, ops(64))], 3)
    assert [(f.kind, f.rank) for f in findings] == [("absent", 2)], lines
    findings, _ = analyze.analyze([_dump(0, ops(48)), _dump(1, ops(64)), _dump(2, ops(64, dtype="int8"))])
    assert [(f.kind, f.rank, f.op) for f in findings] == [("mismatch", 2, "all_to_all_single")]
    assert "float32" in findings[0].detail and "int8" in findings[0].detail


def _unnested(events: list[dict]) -> list[tuple]:
    """The X events that overlap an earlier one of their (pid, tid) without nesting in it: the
    trace format forbids them on one thread, and Perfetto drops them."""
    bad, open_ends = [], {}
    for e in sorted((e for e in events if e["ph"] == "X"), key=lambda e: (e["ts"], -e["dur"])):
        ends = open_ends.setdefault((e["pid"], e["tid"]), [])
        while ends and ends[-1] <= e["ts"]:
            ends.pop()
        if ends and e["ts"] + e["dur"] > ends[-1]:
            bad.append((e["name"], e["args"].get("seq")))
        ends.append(e["ts"] + e["dur"])
    return bad


def test_overlapping_ops_of_one_group_nest_on_their_tracks(tmp_path):
    """A sync op issued while async ones of its group are queued starts (on its record) at once
    and ends after them: async all_reduce seq 1 ran [0, 2], seq 2 [2, 4], the sync seq 3 was
    issued at 1 and ended at 5. On the group's one track seq 1 and seq 3 overlapped without
    nesting (seen in real 2-rank runs: 12 of 62 events), which Perfetto drops. Now every track's
    events nest, the overlapping ones on extra named lanes of their group, none lost."""
    obs = Observer(load_config(None, environ={"COMMRT_LOG_TRACE_FILE": str(tmp_path / "t.json")}), 0, 2)
    g = types.SimpleNamespace(group_id=0, ranks=(0, 1), rank=0, backend=types.SimpleNamespace(name="zmq"))
    first, second = (obs.begin(g, "all_reduce", 4096, torch.float32, async_op=True) for _ in range(2))
    first.start()
    time.sleep(0.005)
    sync = obs.begin(g, "all_reduce", 40, torch.float32)
    time.sleep(0.005)
    first.done(None)
    second.start()
    time.sleep(0.005)
    second.done(None)
    time.sleep(0.005)
    sync.end(None)
    obs.close()
    events = json.load(open(tmp_path / "t.rank0.json"))["traceEvents"]
    assert sorted(e["args"]["seq"] for e in events if e["ph"] == "X") == [1, 2, 3]
    assert _unnested(events) == []
    named = {e["tid"] for e in events if e["name"] == "thread_name"}
    assert {e["tid"] for e in events if e["ph"] == "X"} <= named


def test_the_comms_summary_can_be_read_while_ops_complete(monkeypatch):
    """Async ops complete on their groups' threads and add rows to the comms log while a program
    reads ``commrt.comms_summary()``: a row added meanwhile (a new size bucket) raised
    'RuntimeError: dictionary changed size during iteration' in the reader (seen with a thread
    adding while another read, within seconds). Here the add happens at a fixed point of the
    read, as that thread's would."""
    from commrt.obs import comms
    log = comms.CommsLog()
    log.add("all_reduce", 4096, 0, "zmq", 2, 1e-4)
    real = comms.percentile
    added = []

    def percentile_and_a_completion(values, q):
        if not added:
            added.append(log.add("all_reduce", 1 << 20, 0, "zmq", 2, 1e-3))
        return real(values, q)

    monkeypatch.setattr(comms, "percentile", percentile_and_a_completion)
    rows = log.rows()
    assert [r["bucket"] for r in rows] in ([4096], [1 << 20, 4096])
    assert len(log.rows()) == 2


def test_a_stale_flight_record_of_an_earlier_job_is_left_out(tmp_path):
    """A flight_dir in the config is reused by the next run of the job. Run 1 reached seq 500;
    in run 2 rank 1 was killed (no record of its own) while ranks 0 and 2 waited at seq 21:
    rank 1's file from run 1 made the analysis blame ranks 0 and 2 as 'behind' rank 1. The
    records now carry the job (the bootstrap store's incarnation) and only the newest job's count."""
    def job(dump, number, when):
        return {**dump, "job": number, "time": when}
    old = [{"seq": s, "op": "all_reduce", "nbytes": 40} for s in range(450, 501)]
    new = [{"seq": s, "op": "all_reduce", "nbytes": 40} for s in range(1, 22)]
    dumps = [job(_dump(0, new), 7, 2000.0), job(_dump(1, old), 5, 1000.0), job(_dump(2, new), 7, 2001.0)]
    findings, lines = analyze.analyze(dumps, 3)
    assert [(f.kind, f.rank, f.seq) for f in findings] == [("absent", 1, 21)], lines
    assert any("ranks [1]" in line and "another job" in line for line in lines), lines
    cfg = load_config(None, environ={"COMMRT_LOG_FLIGHT_DIR": str(tmp_path)})
    obs = Observer(cfg, 0, 1, job=7)
    try:
        assert obs.dump("requested") and json.load(open(tmp_path / "rank0.json"))["job"] == 7
    finally:
        obs.close()


def test_trace_merge_finds_the_files_of_a_template_with_the_rank_in_a_directory(tmp_path):
    """``{rank}`` may stand anywhere in [log] trace_file (each rank's writes made its directory),
    but the template's files were only looked for in one directory, the sentinel's:
    ``commrt trace-merge OUT /run{rank}/trace.json`` failed with 'No such file or directory:
    .../run987654321'."""
    template = str(tmp_path / "run{rank}" / "trace-{rank}.json")
    for rank in (0, 1, 10):
        trace.write(trace.rank_path(template, rank), [trace.complete_event("barrier", rank, 0, 1e15, 1.0, {})])
    trace.write(str(tmp_path / "run2" / "trace-3.json"), [])  # not one of the template's: ranks differ
    assert trace.rank_files([template]) == [str(tmp_path / f"run{r}" / f"trace-{r}.json") for r in (0, 1, 10)]


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_STOPPED_WHILE_WRITING = """
import os, signal, sys, types
from commrt.obs import trace
from commrt.obs.observer import Observer
from commrt.runtime.config import load_config
obs = Observer(load_config(None, environ={"COMMRT_LOG_TRACE_FILE": sys.argv[1] + "/trace.json"}), 0, 2)
g = types.SimpleNamespace(group_id=0, ranks=(0, 1), rank=0, backend=types.SimpleNamespace(name="zmq"))
for _ in range(3):
    obs.issued(obs.begin(g, "all_reduce", 400, "float32"), None)
real = trace.nest
def nest_then_stopped(*args):  # the launcher's SIGTERM arrives while close() writes the trace
    os.kill(os.getpid(), signal.SIGTERM)
    return real(*args)
trace.nest = nest_then_stopped
obs.close()  # destroy_process_group, or exit
sys.exit(3)  # not reached: SIGTERM still ends the process
"""


def test_a_rank_stopped_while_it_writes_its_trace_finishes_the_trace_first(tmp_path):
    """close() gave the SIGTERM handler back before it wrote the trace, so SIGTERM during the
    write (a big trace takes seconds; commrt launch stops the ranks when another fails) ended
    the process at once: no trace, and its partial temporary file left behind. Now the write
    ends first, then the process ends by SIGTERM as before."""
    proc = subprocess.run([sys.executable, "-c", _STOPPED_WHILE_WRITING, str(tmp_path)], timeout=60,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == -signal.SIGTERM, proc.stderr
    assert os.listdir(tmp_path) == ["trace.rank0.json"]
    assert [e["args"]["seq"] for e in trace.load(str(tmp_path / "trace.rank0.json")) if e["ph"] == "X"] == [1, 2, 3]


_FORKED_WORKER = """
import os, signal, sys, time, types
from commrt.obs import flight
from commrt.obs.observer import Observer
from commrt.runtime.config import load_config
out = sys.argv[1]
obs = Observer(load_config(None, environ={"COMMRT_LOG_FLIGHT_DIR": out, "COMMRT_LOG_TRACE_FILE": out + "/trace.json"}), 1, 2)
g = types.SimpleNamespace(group_id=0, ranks=(0, 1), rank=1, backend=types.SimpleNamespace(name="zmq"))
obs.issued(obs.begin(g, "all_reduce", 400, "float32"), None)
child = os.fork()  # a DataLoader worker (fork start method) of this rank
if child == 0:
    time.sleep(30)
    os._exit(0)
for _ in range(2):
    obs.issued(obs.begin(g, "all_reduce", 400, "float32"), None)
time.sleep(0.5)
os.kill(child, signal.SIGTERM)  # commrt launch stops the rank's whole process group
_, status = os.waitpid(child, 0)
print("CHILD", os.WTERMSIG(status) if os.WIFSIGNALED(status) else "exit", sorted(os.listdir(out)))
obs.dump("requested")
obs.close()
"""


def test_a_forked_worker_stopped_with_sigterm_writes_no_record_of_its_own(tmp_path):
    """A rank's forked children (DataLoader workers) inherit the observer's SIGTERM handler, and
    commrt launch signals the rank's whole process group: each worker wrote its own flight
    record and trace as the rank's, from its copy of the rank's memory at fork (seq 1 here,
    the rank was at 3), over or under the rank's own files. The worker now just ends."""
    proc = subprocess.run([sys.executable, "-c", _FORKED_WORKER, str(tmp_path)], timeout=60, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr
    assert f"CHILD {int(signal.SIGTERM)} []" in proc.stdout, proc.stdout + proc.stderr
    assert [g["last_seq"] for g in flight.read_dumps(str(tmp_path))[0]["groups"]] == [3]


def test_a_sync_op_queued_behind_async_ones_is_timed_from_its_turn(monkeypatch):
    """A sync op's record started when it was issued, but it runs only once the async ops queued
    before it on its group finished: its comms-log time (and busbw) and its trace event counted
    their time too (in a real 2-rank run a 40-byte all_reduce behind two 1 MiB async ones read
    4-10 ms). Now its start is when it gets the group's turn; the wait shows as queued_us."""
    import threading

    import numpy as np

    from commrt import distributed
    from commrt.runtime.work import Executor
    obs = Observer(load_config(None, environ={"COMMRT_LOG_COMMS": "1"}), 0, 2)
    monkeypatch.setattr(distributed, "_observer", obs)
    ex = Executor("group0")
    g = types.SimpleNamespace(group_id=0, ranks=(0, 1), rank=0, backend=types.SimpleNamespace(name="zmq"))
    gate = threading.Event()
    try:
        ex.submit("all_reduce", gate.wait)  # an async op that holds the group for 0.3 s
        threading.Timer(0.3, gate.set).start()
        rec = distributed._begin(g, "barrier", None, False)
        distributed._call(rec, lambda: ex.run("barrier", lambda: None, 30))
    finally:
        gate.set()
        ex.close()
        obs.close()
    assert rec.started - rec.issued >= 0.25 and rec.ended - rec.started < 0.2, (rec.issued, rec.started, rec.ended)
    (row,) = obs.summary()
    assert row["total_s"] < 0.2, row


def test_ops_that_end_on_several_threads_at_once_are_all_counted():
    """Ops end on several threads (the caller's, a group's executor, the p2p engine's): two
    first ends of one key at once each made the key's row, one replacing the other and its
    count; two later ends could count as one. Threads switching every microsecond, each ending
    one op in each of 2,000 groups, lost a few ends in nearly every round."""
    import sys
    import threading

    from commrt.obs import comms
    threads, groups = 4, 2000

    def ends(log, start):
        start.wait()
        for g in range(groups):
            log.add("send", 4096, g, "zmq", 2, 1e-6)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(10):
            log, start = comms.CommsLog(), threading.Barrier(threads)
            workers = [threading.Thread(target=ends, args=(log, start)) for _ in range(threads)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            rows = log.rows()
            assert len(rows) == groups and all(r["count"] == threads for r in rows), \
                sorted(r["count"] for r in rows if r["count"] != threads)
    finally:
        sys.setswitchinterval(interval)


def test_a_peers_refusal_writes_the_flight_record_as_a_mismatch_does(tmp_path):
    """An op that failed because a peer refused it (OpRefused) broke the group as a mismatch
    does, but wrote no flight record: the one error of the kind left nothing to read after."""
    from commrt.runtime.errors import OpRefused
    obs = Observer(load_config(None, environ={"COMMRT_LOG_FLIGHT_DIR": str(tmp_path)}), 0, 2)
    try:
        obs.completed(None, OpRefused(1, "all_reduce", 3, "ValueError: a read-only output"))
        assert "rank 1 refused all_reduce" in json.load(open(tmp_path / "rank0.json"))["reason"]
    finally:
        obs.close()
