"""The server's request logic against requests a buggy or hostile job member can send (issue 13
items 8, 9, 11, 14): far-future pulls, floods of parked requests, pushes from workers whose
init failed or never happened, and the durable log's size. Fed frames directly, no sockets."""
import os
import sys

import numpy as np
import pytest

from commrt.optim import rules as optim
from commrt.runtime.config import PsConfig
from commrt.ps import protocol as P
from commrt.ps.core import ServerCore
from commrt.ps.durable import read_log
from commrt.ps.state import ShardState

SEGS = [["w", 0, 4, 1], ["w", 4, 6, 1]]
SHAPES = [["w", [2, 3]]]


def _init(core, worker, seed, segs=SEGS, shapes=SHAPES, values=None, rid=1):
    frames = [P.encode_request(P.INIT, worker, 0, rid, [seed, segs, shapes])]
    if seed:
        v = np.arange(6, dtype=np.float32) if values is None else values
        frames += [v[:4].tobytes(), v[4:].tobytes()]
    return [(r.ident, P.decode_reply(r.frames[0])) for r in core.handle(f"w{worker}".encode(), frames, 0.0)]


def _core(mode="sync", workers=2, join=True, **kw):
    cfg = PsConfig(servers=("tcp://127.0.0.1:1",), workers=workers, mode=mode, lr=0.5, **kw)
    core = ServerCore(cfg, 0, ShardState(optim.OptimSpec("sgd", lr=0.5), workers))
    assert _init(core, 0, True)[0][1].status == P.OK
    for w in range(1, workers if join else 1):
        assert _init(core, w, False)[0][1].status == P.OK
    return core


def _push(core, worker, step, grad=None, rid=7, now=0.0):
    g = np.zeros(6, dtype=np.float32) if grad is None else np.asarray(grad, dtype=np.float32)
    head = P.encode_request(P.PUSH, worker, step, rid, [0, 1])
    return [(r.ident, P.decode_reply(r.frames[0])) for r in
            core.handle(f"w{worker}".encode(), [head, g[:4].tobytes(), g[4:].tobytes()], now)]


def _pull(core, worker, step, rid, now=0.0):
    out = core.handle(f"w{worker}".encode(), [P.encode_request(P.PULL, worker, step, rid, [0, 1])], now)
    return [(r.ident, P.decode_reply(r.frames[0])) for r in out]


def _params(core):
    return np.concatenate(core.state.params)


# -- 13.8: a pull for a step no schedule can reach ---------------------------------------------


@pytest.mark.parametrize("mode", ["sync", "ssp"])
def test_far_future_pull_is_refused_and_drops_nobody(mode):
    core = _core(mode=mode, staleness=2, worker_timeout_s=1.0, on_worker_loss="continue")
    for step in (10 ** 9, 1):
        reply = _pull(core, 1, step, rid=5)
        assert len(reply) == 1 and reply[0][1].status == P.ERROR and "ahead" in reply[0][1].body[0], reply
    assert core.tick(5.0) == [] and core.state.dropped == set()
    assert _pull(core, 1, 0, rid=6)[0][1].status == P.OK  # a client pulls at its own step


# -- 13.9: parked requests are bounded per worker and served without scanning them all -----------


def _ahead(workers: int, fast: range):
    """SSP with s = 2: worker 0 still at step 0, the ``fast`` workers at step 3 (the bound), so
    their pulls at step 3 legitimately wait for worker 0."""
    core = _core(mode="ssp", staleness=2, workers=workers)
    for w in fast:
        for step in range(3):
            assert _push(core, w, step)[0][1].status == P.OK
    return core


def test_parked_pulls_are_bounded_per_worker():
    core = _ahead(3, range(1, 3))
    replies = [r for rid in range(1, 200) for r in _pull(core, 1, 3, rid)]
    assert replies and all(r.status == P.ERROR and "parked" in r.body[0] for _, r in replies), replies[:3]
    assert len(replies) >= 150  # all but the first few were refused
    assert _pull(core, 2, 3, rid=999) == []  # another worker is not affected
    served = _push(core, 0, 0)  # worker 0 catches up: every parked pull is answered
    assert sum(1 for _, r in served if r.status == P.OK and r.body[0] == 7) >= 2


def _line_events(fn) -> int:
    """How many lines of commrt/ps run inside ``fn()``: work done, independent of the clock."""
    here = os.path.dirname(os.path.abspath(sys.modules[ServerCore.__module__].__file__))
    count = 0

    def trace(frame, event, arg):
        nonlocal count
        if not frame.f_code.co_filename.startswith(here):
            return None
        if event == "line":
            count += 1
        return trace
    sys.settrace(trace)
    try:
        fn()
    finally:
        sys.settrace(None)
    return count


def _cost_of_a_step(parked_per_worker: int, workers: int = 12) -> int:
    core = _ahead(workers, range(1, workers - 1))
    for w in range(1, workers - 1):
        for rid in range(parked_per_worker):  # legitimate, and not served by what follows
            assert _pull(core, w, 3, 100 + rid) == []
    last = workers - 1
    for step in range(2):
        _push(core, last, step)

    def a_push_pings_and_a_tick():
        assert _push(core, last, 2)[0][1].status == P.OK  # applied; worker 0 still holds everyone
        for w in range(workers):
            core.handle(b"p", [P.encode_request(P.PING, w, 0, 12345, [])], 0.0)
        core.tick(0.5)
    return _line_events(a_push_pings_and_a_tick)


def test_serving_does_not_scan_every_parked_request():
    few, many = _cost_of_a_step(0), _cost_of_a_step(8)  # 0 vs 80 parked pulls
    assert many < few + 200, (few, many)


# -- 13.11: pushes are bound to the agreed description -------------------------------------------


def test_a_worker_that_never_initialised_is_refused():
    core = _core(join=False)
    before = _params(core).copy()
    for reply in (_push(core, 1, 0, np.ones(6)), _pull(core, 1, 0, rid=3)):
        assert reply[0][1].status == P.ERROR and "init" in reply[0][1].body[0], reply
    assert np.array_equal(_params(core), before) and not core.pushes


def test_an_early_init_waits_for_the_seed_and_is_then_checked():
    cfg = PsConfig(servers=("tcp://127.0.0.1:1",), workers=3, lr=0.5)
    core = ServerCore(cfg, 0, ShardState(optim.OptimSpec("sgd", lr=0.5), 3))
    assert _init(core, 1, False, segs=[["v", 0, 4, 1], ["v", 4, 6, 1]], shapes=[["v", [2, 3]]]) == []
    assert _init(core, 2, False) == []  # parked until the seed, then accepted
    out = dict(_init(core, 0, True))
    assert out[b"w0"].status == P.OK and out[b"w2"].status == P.OK
    assert out[b"w1"].status == P.ERROR and "different parameters" in out[b"w1"].body[0], out
    assert _push(core, 1, 0)[0][1].status == P.ERROR  # its init failed: no pushes


def test_shapes_are_compared():
    core = _core(join=False)
    reply = _init(core, 1, False, shapes=[["w", [3, 2]]])
    assert reply[0][1].status == P.ERROR and "(3, 2)" in reply[0][1].body[0], reply
    assert _push(core, 1, 0)[0][1].status == P.ERROR


def test_a_refused_init_under_an_accepted_workers_identity_changes_nothing():
    """issue 30 item 7: a second client claiming worker 0 with another description is refused,
    and worker 0's accepted registration, its pulls and the parameters stay as they were."""
    core = _core()
    before, joined = _params(core).copy(), set(core.state.joined)
    reply = _init(core, 0, False, shapes=[["w", [3, 2]]], rid=9)
    assert reply[0][1].status == P.ERROR and "different parameters" in reply[0][1].body[0], reply
    assert core.state.joined == joined and np.array_equal(_params(core), before)
    assert _pull(core, 0, 0, rid=10)[0][1].status == P.OK


# -- 13.14: the log between checkpoints is bounded ------------------------------------------------


def test_the_log_is_checkpointed_away_at_its_size_bound(tmp_path):
    core = _core(workers=1, checkpoint_dir=str(tmp_path), checkpoint_every=1000, max_log_bytes=1000)
    wal = tmp_path / "server-0.wal"
    biggest = 0
    for step in range(60):
        assert _push(core, 0, step, np.full(6, 0.01 * step))[0][1].status == P.OK
        biggest = max(biggest, wal.stat().st_size)
    record = max(1, wal.stat().st_size // max(1, len(list(read_log(str(wal))))))
    assert biggest <= 1000 + 2 * record, biggest
    # and the bounded log still recovers the exact state
    again = ServerCore(core.cfg, 0, ShardState(optim.OptimSpec("sgd", lr=0.5), 1))
    again.resume()
    assert np.array_equal(_params(again), _params(core)) and again.state.version == 60


def test_an_error_naming_long_segment_names_reaches_the_client_readable():
    """Two descriptions of a 489-character parameter name (legal: under MAX_NAME) made an ERROR
    reply the client's header limits could not decode: it re-sent the init and finally blamed
    an unreadable header instead of saying that the segments differ."""
    name = "encoder." + "layers.0.attention." * 25 + "weight"
    core = ServerCore(PsConfig(servers=("tcp://127.0.0.1:1",), workers=2), 0, ShardState(optim.OptimSpec("sgd"), 2))
    (_, seeded), = _init(core, 0, True, segs=[[name, 0, 4, 1], [name, 4, 6, 1]], shapes=[[name, [2, 3]]])
    assert seeded.status == P.OK
    (_, reply), = _init(core, 1, False, segs=[[name, 0, 5, 1], [name, 5, 6, 1]], shapes=[[name, [2, 3]]])
    assert reply.status == P.ERROR and "segments differ" in reply.body[0] and name in reply.body[0]


def test_a_lost_reply_naming_hundreds_of_workers_is_readable_and_short():
    """Sync, 320 workers, 264 silent: every waiting push gets LOST naming them. The message grew
    past the client's string limit: it dropped the reply, re-sent the push and waited again,
    for ever. Now it lists 32 and counts the rest; the body keeps every id."""
    workers, pushing = 320, 56
    core = _core(workers=workers, worker_timeout_s=30.0)
    for w in range(pushing):
        assert _push(core, w, 0, now=1.0) == []  # parked until the step is complete
    lost = [P.decode_reply(r.frames[0]) for r in core.tick(100.0)]
    assert len(lost) == pushing and all(r.status == P.LOST for r in lost)
    assert lost[0].body[1] == list(range(pushing, workers)) and "and 232 more" in lost[0].body[0]
    assert P.clip("x" * (P.MAX_TEXT + 10)).endswith("(74 more characters)")
