"""Parameter-server pieces without processes: partition, protocol, on-disk formats, optimizers,
and the server's request logic fed frames directly (validation, exactly-once, fuzz)."""
import logging
import random
import time

import numpy as np
import pytest
import torch

from commrt.optim import rules as optim
from commrt.launch import free_port
from commrt.ps import exchange
from commrt.ps.client import PSClient
from commrt.runtime.config import PsConfig, load_config
from commrt.runtime.errors import PeerLost, ProtocolError
from commrt.ps import protocol as P
from commrt.ps.core import ServerCore
from commrt.ps.durable import WriteAheadLog, load_checkpoint, read_log, save_checkpoint
from commrt.ps.partition import TensorSpec, partition
from commrt.ps.state import ShardState

# -- partition -------------------------------------------------------------------------------


def _specs(sizes):
    return [TensorSpec(f"t{i}", n, 4, 1) for i, n in enumerate(sizes)]


@pytest.mark.parametrize("sizes", [[1], [10, 0, 3], [1000, 7, 333, 4096, 1], [5] * 17, [1 << 20, 3]])
@pytest.mark.parametrize("servers", [1, 2, 3, 5])
@pytest.mark.parametrize("whole", [False, True])
def test_partition_covers_every_element_once(sizes, servers, whole):
    segs = partition(_specs(sizes), servers, max_segment_bytes=1024, whole_tensors=whole)
    for i, n in enumerate(sizes):
        mine = sorted((s.start, s.stop) for s in segs if s.name == f"t{i}")
        covered = [e for a, b in mine for e in range(a, b)]
        assert covered == list(range(n)), (i, mine)
        if whole and n:
            assert len({s.server for s in segs if s.name == f"t{i}" and s.numel}) == 1
    assert all(s.numel * 4 <= 1024 for s in segs)
    assert all(0 <= s.server < servers for s in segs)


def test_partition_is_byte_balanced():
    sizes = [1000, 7, 333, 4096, 1, 50000]
    segs = partition(_specs(sizes), 4, max_segment_bytes=1 << 30)
    load = [sum(s.numel * 4 for s in segs if s.server == k) for k in range(4)]
    assert max(load) - min(load) <= 8, load
    assert partition(_specs(sizes), 4, 1 << 30) == segs  # deterministic: every worker agrees


# -- protocol --------------------------------------------------------------------------------


def test_protocol_round_trip():
    head = P.encode_request(P.PUSH, 3, 7, 11, [0, 2, 5])
    assert P.decode_request(head) == P.Request(P.PUSH, 3, 7, 11, [0, 2, 5])
    init = P.encode_request(P.INIT, 0, 0, 1, [True, [["w", 0, 10, 1]], [["w", [2, 5]]]])
    assert P.decode_request(init).body == [True, [["w", 0, 10, 1]], [["w", [2, 5]]]]
    assert P.decode_reply(P.encode_reply(P.LOST, 4, ["gone", [2]])) == P.Reply(P.LOST, 4, ["gone", [2]])


@pytest.mark.parametrize("buf", [
    b"", b"\xc1", b"\x93\x01\x02\x03", P.encode_request(99, 0, 0, 0, []),
    P.encode_request(P.PUSH, -1, 0, 0, []), P.encode_request(P.PUSH, 0, 0, 0, ["x"]),
    P.encode_request(P.INIT, 0, 0, 0, [True, [["w", 5, 1, 1]], []]),
    P.encode_request(P.INIT, 0, 0, 0, [True, [["w", 0, 1, 99]], []]),
    P.encode_request(P.INIT, 0, 0, 0, [True, [["w", 0, 1, 1]]]),  # no shapes
    P.encode_request(P.INIT, 0, 0, 0, [True, [["w", 0, 1, 1]], [["w", [-1]]]]),
    P.encode_request(P.PING, 0, 0, 0, [1]),
    b"\xd4\x01\x00",  # an extension type
    b"\xdd\xff\xff\xff\xff",  # an array claiming 4G entries
])
def test_protocol_rejects_malformed(buf):
    with pytest.raises(ProtocolError):
        P.decode_request(buf)


def test_protocol_fuzz_never_crashes_otherwise():
    rng = random.Random(5)
    valid = P.encode_request(P.PUSH, 1, 2, 3, [0, 1, 2])
    for _ in range(3000):
        buf = bytearray(valid)
        for _ in range(rng.randint(1, 4)):
            buf[rng.randrange(len(buf))] = rng.randrange(256)
        buf = bytes(buf[:rng.randint(0, len(buf))]) if rng.random() < 0.3 else bytes(buf)
        try:
            P.decode_request(buf)
        except ProtocolError:
            pass


# -- durable formats -------------------------------------------------------------------------


def test_checkpoint_round_trip(tmp_path):
    path = str(tmp_path / "c.ckpt")
    arrays = [np.arange(5, dtype=np.float32), np.ones(3, dtype=np.float64)]
    save_checkpoint(path, {"version": 4}, arrays, [1, 2])
    meta, back = load_checkpoint(path)
    assert meta["version"] == 4 and all(np.array_equal(a, b) for a, b in zip(arrays, back))
    with open(path, "r+b") as fh:
        fh.truncate(40)
    with pytest.raises(ProtocolError):
        load_checkpoint(path)


def test_log_ignores_a_torn_tail(tmp_path):
    path = str(tmp_path / "w.log")
    wal = WriteAheadLog(path, fsync=False)
    for v in range(3):
        wal.append({"v": v}, [np.full(4, v, dtype=np.float32)], [1])
    wal.close()
    size = len(open(path, "rb").read())
    with open(path, "r+b") as fh:
        fh.truncate(size - 3)
    assert [m["v"] for m, _ in read_log(path)] == [0, 1]


# -- optimizers ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,kw,torch_opt", [
    ("sgd", dict(lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1)),
    ("sgd", dict(lr=0.1, momentum=0.9, weight_decay=0.01),
     lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01)),
    ("sgd", dict(lr=0.1, momentum=0.9, nesterov=True),
     lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True)),
    ("adamw", dict(lr=0.01, weight_decay=0.1),
     lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1, foreach=False)),
])
def test_optimizers_match_torch(kind, kw, torch_opt):
    torch.manual_seed(0)
    ref = torch.randn(50, requires_grad=True)
    mine = ref.detach().clone()
    opt, spec = torch_opt([ref]), optim.OptimSpec(kind, **kw)
    state = optim.init_state(spec, mine)
    for step in range(1, 6):
        g = torch.randn(50)
        ref.grad = g.clone()
        opt.step()
        optim.step_(mine, g, state, spec, step)
    torch.testing.assert_close(mine, ref.detach(), rtol=0, atol=1e-7)


def _lamb_reference(w, grads, lr, b1, b2, eps, wd):
    """LAMB (You et al. 2019, Algorithm 2) in float64 numpy."""
    w, m, v = w.astype(np.float64), np.zeros_like(w, np.float64), np.zeros_like(w, np.float64)
    for t, g in enumerate(grads, 1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        r = (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps) + wd * w
        wn, rn = np.linalg.norm(w), np.linalg.norm(r)
        w = w - lr * (wn / rn if wn > 0 and rn > 0 else 1.0) * r
    return w


def test_lamb_matches_the_paper_and_splits_exactly():
    rng = np.random.default_rng(1)
    w0 = rng.standard_normal(40).astype(np.float32)
    grads = [rng.standard_normal(40).astype(np.float32) for _ in range(4)]
    spec = optim.OptimSpec("lamb", lr=0.05, weight_decay=0.01)
    whole, st = torch.from_numpy(w0.copy()), None
    st = optim.init_state(spec, whole)
    halves = [torch.from_numpy(w0[:15].copy()), torch.from_numpy(w0[15:].copy())]
    sts = [optim.init_state(spec, h) for h in halves]
    for t, g in enumerate(grads, 1):
        optim.step_(whole, torch.from_numpy(g), st, spec, t)
        rs = [optim.lamb_direction_(h, torch.from_numpy(gp), s, spec, t)
              for h, gp, s in zip(halves, (g[:15], g[15:]), sts)]
        trust = optim.trust_ratio(float(sum(h.double().square().sum() for h in halves)) ** 0.5,
                                  float(sum(r.double().square().sum() for r in rs)) ** 0.5)
        for h, r in zip(halves, rs):
            optim.lamb_apply_(h, r, trust, spec)
    ref = _lamb_reference(w0, grads, 0.05, 0.9, 0.999, 1e-8, 0.01)
    np.testing.assert_allclose(whole.numpy(), ref, rtol=0, atol=1e-6)
    np.testing.assert_allclose(torch.cat(halves).numpy(), whole.numpy(), rtol=0, atol=1e-6)


# -- server request logic --------------------------------------------------------------------


def _core(mode="sync", workers=2, **kw):
    cfg = PsConfig(servers=("tcp://127.0.0.1:1",), workers=workers, mode=mode, lr=0.5, **kw)
    core = ServerCore(cfg, 0, ShardState(optim.OptimSpec("sgd", lr=0.5), workers))
    values = np.arange(6, dtype=np.float32)
    segs, shapes = [["w", 0, 4, 1], ["w", 4, 6, 1]], [["w", [6]]]
    init = P.encode_request(P.INIT, 0, 0, 1, [True, segs, shapes])
    out = core.handle(b"w0", [init, values[:4].tobytes(), values[4:].tobytes()], 0.0)
    assert P.decode_reply(out[0].frames[0]).status == P.OK
    for w in range(1, workers):
        out = core.handle(b"w", [P.encode_request(P.INIT, w, 0, 1, [False, segs, shapes])], 0.0)
        assert P.decode_reply(out[0].frames[0]).status == P.OK
    return core


def _push(core, worker, step, grad, rid=7, now=0.0, op=P.PUSH):
    g = np.asarray(grad, dtype=np.float32)
    head = P.encode_request(op, worker, step, rid, [0, 1])
    return [(r.ident, P.decode_reply(r.frames[0])) for r in
            core.handle(f"w{worker}".encode(), [head, g[:4].tobytes(), g[4:].tobytes()], now)]


def _params(core):
    return np.concatenate(core.state.params)


def test_sync_applies_once_all_workers_pushed_and_deduplicates():
    core = _core()
    assert _push(core, 0, 0, np.ones(6)) == []  # waits for worker 1
    out = _push(core, 1, 0, 3 * np.ones(6))
    assert sorted(i for i, _ in out) == [b"w0", b"w1"] and all(r.status == P.OK for _, r in out)
    np.testing.assert_allclose(_params(core), np.arange(6) - 0.5 * 2)
    again = _push(core, 1, 0, 100 * np.ones(6))  # a re-send: acknowledged, not applied
    assert again[0][1].status == P.DUPLICATE
    np.testing.assert_allclose(_params(core), np.arange(6) - 0.5 * 2)
    assert core.state.version == 1 and core.counters["duplicates"] == 1


@pytest.mark.parametrize("frames,needle", [
    (lambda: [P.encode_request(P.PUSH, 0, 0, 1, [0, 9]), b"\0" * 16, b"\0" * 8], "segment ids"),
    (lambda: [P.encode_request(P.PUSH, 0, 0, 1, [0, 1]), b"\0" * 12, b"\0" * 8], "needs 16 bytes"),
    (lambda: [P.encode_request(P.PUSH, 0, 0, 1, [0, 1]), b"\0" * 16], "payload frames"),
    (lambda: [P.encode_request(P.PUSH, 5, 0, 1, [0, 1]), b"\0" * 16, b"\0" * 8], "out of range"),
    (lambda: [P.encode_request(P.PUSH, 0, 50, 1, [0, 1]), b"\0" * 16, b"\0" * 8], "too far ahead"),
    (lambda: [P.encode_request(P.INIT, 1, 0, 1, [False, [["w", 0, 6, 1]], [["w", [6]]]])], "different parameters"),
    (lambda: [P.encode_request(P.INIT, 1, 0, 1, [True, [["w", 0, 6, 7]], [["w", [6]]]])], "float32 or float64"),
])
def test_bad_requests_get_an_error_and_change_nothing(frames, needle):
    core = _core()
    before = (_params(core).copy(), core.state.version, list(core.state.clocks), len(core.pushes))
    out = core.handle(b"x", frames(), 0.0)
    reply = P.decode_reply(out[0].frames[0])
    assert reply.status == P.ERROR and needle in reply.body[0], reply
    assert np.array_equal(_params(core), before[0])
    assert (core.state.version, core.state.clocks, len(core.pushes)) == before[1:]


def test_stale_push_beyond_the_window_is_refused():
    core = _core(workers=1)
    for step in range(70):
        assert _push(core, 0, step, np.zeros(6))[0][1].status == P.OK
    assert _push(core, 0, 69, np.zeros(6))[0][1].status == P.DUPLICATE
    reply = _push(core, 0, 2, np.zeros(6))[0][1]
    assert reply.status == P.ERROR and "stale push" in reply.body[0]


def test_ssp_holds_a_worker_at_the_bound():
    core = _core(mode="ssp", staleness=1)
    assert _push(core, 0, 0, np.zeros(6))[0][1].status == P.OK
    assert _push(core, 0, 1, np.zeros(6))[0][1].status == P.OK  # 1 ahead of worker 1: allowed
    assert _push(core, 0, 2, np.zeros(6)) == []  # 2 ahead: parked
    out = _push(core, 1, 0, np.zeros(6))
    assert sorted(i for i, _ in out) == [b"w0", b"w1"]  # worker 1 caught up: both go through
    assert max(core.state.staleness) <= 1


def test_lost_worker_policies():
    core = _core(worker_timeout_s=1.0)
    _push(core, 0, 0, np.ones(6), now=0.0)
    out = core.tick(2.0)
    reply = P.decode_reply(out[0].frames[0])
    assert reply.status == P.LOST and reply.body[1] == [1] and core.state.version == 0
    core = _core(worker_timeout_s=1.0, on_worker_loss="continue")
    _push(core, 0, 0, np.ones(6), now=0.0)
    out = core.tick(2.0)
    assert P.decode_reply(out[0].frames[0]).status == P.OK and core.state.dropped == {1}
    np.testing.assert_allclose(_params(core), np.arange(6) - 0.5)


def test_a_lost_sync_step_answers_every_push_alike():
    """Worker 0 pushed at 0.0, worker 1 at 0.5, worker 2 never: at worker 0's timeout both learn
    that worker 2 is missing. Answered one tick apart, worker 1 was told worker 0 was missing too
    (a 3-worker job under load, tests/multirank/test_ps.py)."""
    core = _core(workers=3, worker_timeout_s=1.0)
    assert _push(core, 0, 0, np.ones(6), now=0.0, op=P.PUSHPULL) == []
    assert _push(core, 1, 0, np.ones(6), now=0.5, op=P.PUSHPULL) == []
    out = [(r.ident, P.decode_reply(r.frames[0])) for r in core.tick(1.2)]
    assert sorted(i for i, _ in out) == [b"w0", b"w1"], out
    assert all(r.status == P.LOST and r.body[1] == [2] for _, r in out), out
    assert core.tick(2.0) == [] and core.state.version == 0


def test_handler_fuzz_keeps_serving(monkeypatch):
    import logging
    import tracemalloc
    # the handler logs each rejection; pytest keeps every captured record, which is not ours to measure
    monkeypatch.setattr(logging.getLogger("commrt.ps.core"), "disabled", True)
    core = _core()
    rng = random.Random(9)
    valid = [P.encode_request(P.PUSH, 0, 0, 7, [0, 1]), b"\0" * 16, b"\0" * 8]
    before = _params(core).copy()
    tracemalloc.start()
    for i in range(4000):
        if i == 1000:  # memory after warm-up; it must stay flat from here
            base = tracemalloc.get_traced_memory()[0]
        frames = [bytearray(f) for f in valid[:rng.randint(0, 3)]]
        for f in frames:
            for _ in range(rng.randint(0, 3)):
                if f:
                    f[rng.randrange(len(f))] = rng.randrange(256)
        if rng.random() < 0.2:
            frames.append(bytes(rng.randrange(256) for _ in range(rng.randint(0, 64))))
        try:
            core.handle(b"fuzz", [bytes(f) for f in frames], 0.0)
        except Exception as exc:  # the handler must never raise
            pytest.fail(f"handler raised {type(exc).__name__}: {exc} on {frames!r}")
        for p in core.waiting.all():  # what was accepted as valid is not the point here
            core.waiting.remove(p)
    grown = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert grown < 256 << 10, f"memory grew by {grown} bytes over 3000 malformed requests"
    assert core.counters["malformed"] > 0 and core.counters["rejected"] > 0
    assert np.array_equal(_params(core), before)


def test_metrics_collector_shows_stats_and_a_cumulative_histogram():
    """The Prometheus page is server-status's numbers: counters, per-worker lag, and the
    apply-latency buckets made cumulative (parsed back with the client library's parser)."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from commrt.ps.metrics import COUNTERS, MetricsServer, ServerCollector
    stats = {**{k: i + 1 for i, k in enumerate(COUNTERS)}, "server": 1, "version": 7, "param_bytes": 64,
             "clocks": [5, 3], "lag": [0, 2], "parked": {"pushes": 1, "pulls": 0, "inits": 0}, "dropped": [],
             "joined": [0, 1], "segments": 4, "staleness": {"0": 5, "2": 1},
             "apply_latency": {"buckets": [0.001, 0.01], "counts": [2, 1, 3], "sum": 1.5, "count": 6}}
    server = MetricsServer(lambda: stats, "127.0.0.1", 0)
    try:
        text = generate_latest(server.registry).decode()
    finally:
        server.close()
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for fam in text_string_to_metric_families(text) for s in fam.samples}
    srv = (("server", "1"),)
    assert all(got[(f"{name}_total", srv)] == stats[key] for key, (name, _) in COUNTERS.items())
    assert got[("commrt_ps_worker_lag", (("server", "1"), ("worker", "1")))] == 2
    assert [got[("commrt_ps_apply_seconds_bucket", (("le", le), ("server", "1")))] for le in ("0.001", "0.01", "+Inf")] \
        == [2, 3, 6]
    assert got[("commrt_ps_apply_seconds_count", srv)] == 6
    assert got[("commrt_ps_updates_by_staleness_total", (("gap", "2"), ("server", "1")))] == 1
    ServerCollector(lambda: stats)  # a collector of its own per server: nothing in the global registry
    from prometheus_client import REGISTRY
    assert not [n for n in REGISTRY._names_to_collectors if n.startswith("commrt_")]


def test_metrics_port_in_use_is_a_config_error():
    import socket

    from commrt.runtime.errors import ConfigError
    from commrt.ps.metrics import MetricsServer
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(ConfigError, match="cannot serve metrics on 127.0.0.1"):
            MetricsServer(dict, "127.0.0.1", busy.getsockname()[1])


@pytest.mark.parametrize("port", [-1, 65536])
def test_metrics_port_out_of_range_is_refused(port):
    from commrt.runtime.config import load_config
    from commrt.runtime.errors import ConfigError
    with pytest.raises(ConfigError, match="metrics_port"):
        load_config(environ={"COMMRT_PS_METRICS_PORT": str(port)})


def test_a_worker_with_no_server_says_what_it_waits_for_then_waits_to_the_deadline(monkeypatch, caplog):
    """issue 31 item 3: silent for the whole [ps] timeout_s before its PeerLost."""
    monkeypatch.setattr(exchange, "WAIT_NOTICE_S", 0.5)
    server = f"tcp://127.0.0.1:{free_port()}"  # nobody listens there
    cfg = load_config(overrides={"ps": {"servers": [server], "workers": 1, "timeout_s": 2.5}}, environ={})
    client = PSClient(cfg, worker=0)
    start = time.monotonic()
    try:
        with caplog.at_level(logging.WARNING, logger="commrt.ps.client"), pytest.raises(PeerLost, match="server"):
            client.init({"w": torch.zeros(4)})
    finally:
        client.close()
    assert time.monotonic() - start >= 2.5  # the notice does not shorten the wait
    notices = [r.getMessage() for r in caplog.records if "waiting for server 0" in r.getMessage()]
    assert len(notices) == 1 and server in notices[0] and "ps.init" in notices[0], caplog.text


def test_metrics_server_threads_stay_bounded_under_idle_connections():
    """issue 30 item 14: prometheus_client's server held a thread per idle connection (310 for
    300). Here at most MAX_CONNECTIONS, the rest refused; a scrape works once they are gone."""
    import socket
    import threading
    import time
    import urllib.error
    import urllib.request

    from commrt.ps import metrics
    server = metrics.MetricsServer(dict, "127.0.0.1", 0)
    before, idle = set(threading.enumerate()), []
    try:
        for _ in range(100):
            idle.append(socket.create_connection(("127.0.0.1", server.port)))
        time.sleep(0.5)
        started = [t for t in threading.enumerate() if t not in before]  # other tests' threads do not count
        assert len(started) <= metrics.MAX_CONNECTIONS, started
        for s in idle:
            s.close()
        idle = []
        deadline = time.monotonic() + 10
        while True:  # the served ones end when their client closes
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as reply:
                    assert reply.status == 200
                break
            except urllib.error.HTTPError:  # answered (the empty stats make the collector fail)
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
    finally:
        for s in idle:
            s.close()
        server.close()


def test_metrics_server_drops_connections_that_drip_their_request(monkeypatch):
    """Found in the hardening review (wtT4): IDLE_S bounded each read, not the request, so
    MAX_CONNECTIONS clients sending a byte now and then held every slot for good and no scrape
    got through. Now a request must be complete within IDLE_S in all."""
    import socket
    import threading
    import time
    import urllib.error
    import urllib.request

    from commrt.ps import metrics
    monkeypatch.setattr(metrics, "IDLE_S", 0.5)
    server = metrics.MetricsServer(lambda: {"server": 0}, "127.0.0.1", 0)
    slow = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(metrics.MAX_CONNECTIONS)]
    stop = threading.Event()

    def drip():  # one byte per connection every 0.2 s: never idle for IDLE_S
        while not stop.wait(0.2):
            for s in slow:
                try:
                    s.send(b"G")
                except OSError:
                    pass
    dripper = threading.Thread(target=drip, daemon=True)
    dripper.start()
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=2):
                    break
            except urllib.error.HTTPError:  # answered (the partial stats make the collector fail)
                break
            except OSError:  # refused at accept while the slots are held
                assert time.monotonic() < deadline, "the dripping connections held every slot"
                time.sleep(0.1)
    finally:
        stop.set()
        dripper.join(2)
        for s in slow:
            s.close()
        server.close()
