"""The bootstrap store: request validation and parked waits (StoreCore, pure), then the real
server and clients over loopback: malformed requests, re-initialisation on the same port, and
a 4096-rank rendezvous."""
import math
import threading
import time

import msgpack
import pytest
import zmq

from commrt.runtime import rendezvous
from commrt.runtime.config import load_config
from commrt.runtime.errors import ProtocolError, RendezvousError
from commrt.launch import free_port
from commrt.runtime.store import StoreClient, StoreServer, wait_for
from commrt.runtime.store_core import ABORT, MAX_FRAME, MAX_VALUE, OK, TIMEOUT, StoreCore
from commrt.transport.transport import Transport
from commrt.transport.rpc import REQUEST, Envelope, decode, encode

CFG = load_config(overrides={"security": {"mode": "none"}, "comm": {"timeout_s": 20}}, environ={})


def _req(core, method, *args, now=0.0, token="t"):
    return core.handle(method, [core.incarnation, *args], token, now)


@pytest.mark.parametrize("method,args,needle", [
    ("mget", [], "takes 1 arguments"), ("add", ["k", math.inf], "within int64"),
    ("add", ["k", 2**64 - 1], "within int64"), ("add", ["k", True], "within int64"),
    ("add", ["k", 1.0], "within int64"), ("set", ["k", "text"], "bytes"), ("set", [7, b"v"], "key must be"),
    ("set", ["k" * 257, b"v"], "key must be"), ("mget", ["k"], "list of keys"), ("mget", [[None]], "key must be"),
    ("wait", [["k"], None, math.nan], "timeout"), ("wait", [["k"], None, -1], "timeout"),
    ("wait_count", ["k", 1, 5, 1.0], "abort key"), ("drop", [], "unknown store method"),
    ("add_wait_count", ["k", 1, 2, None], "takes 5 arguments"), ("add_wait_count", ["k", 1.5, 2, None, 1.0], "int64"),
    ("add_wait_count", ["k", 1, 2, None, -1], "timeout"),
])
def test_malformed_requests_are_refused_and_change_nothing(method, args, needle):
    """Issue 12.4 / 13.7: each of these killed the old store's serving thread."""
    core = StoreCore()
    _req(core, "set", "a", b"1")
    before = dict(core.data)
    with pytest.raises(ProtocolError, match=needle):
        _req(core, method, *args)
    assert core.data == before


def test_counters_stay_within_int64():
    core = StoreCore()
    assert _req(core, "add", "c", 2**63 - 1) == [OK, 2**63 - 1]
    with pytest.raises(ProtocolError, match="after adding 1"):
        _req(core, "add", "c", 1)
    assert _req(core, "add", "c", 0) == [OK, 2**63 - 1]
    _req(core, "set", "b", b"x")
    with pytest.raises(ProtocolError, match="holds bytes"):
        _req(core, "add", "b", 1)


def test_a_request_of_another_incarnation_is_refused():
    core = StoreCore()
    assert core.handle("hello", [], None, 0) == [OK, core.incarnation]
    with pytest.raises(ProtocolError, match="earlier init_process_group"):
        core.handle("set", [core.incarnation + 1, "k", b"v"], None, 0)


def test_parked_waits_are_answered_by_arrivals_aborts_and_deadlines():
    core = StoreCore()
    assert _req(core, "wait", ["a", "b"], "abort", 10.0, token="w1") is None
    assert _req(core, "wait", ["c"], "abort", 10.0, token="w2") is None
    assert _req(core, "wait_count", "n", 3, None, 5.0, token="w3") is None
    assert _req(core, "wait", ["z"], None, 1.0, token="w4") is None
    _req(core, "set", "b", b"B")
    _req(core, "set", "a", b"A")
    assert core.take_answered() == [("w1", [OK, [b"A", b"B"]])]
    _req(core, "add", "n", 2)
    assert core.take_answered() == []
    _req(core, "add", "n", 1)
    assert core.take_answered() == [("w3", [OK, 3])]
    _req(core, "set", "abort", b"rank 3 is a duplicate")
    assert core.take_answered() == [("w2", [ABORT, b"rank 3 is a duplicate"])]
    core.expire(0.5)
    assert core.take_answered() == []
    core.expire(1.0)
    assert core.take_answered() == [("w4", [TIMEOUT, ["z"]])]
    assert _req(core, "wait", ["a"], "abort", 1.0) == [ABORT, b"rank 3 is a duplicate"]
    assert _req(core, "wait", ["q"], None, 0.0) == [TIMEOUT, ["q"]]
    _req(core, "set", "q", b"")  # the expired wait sits in q's index: it must stay answered once
    assert core.take_answered() == []


def test_add_wait_count_adds_then_waits_in_one_request():
    """The replica vote's one round trip (issue 33.5): each voter's reply carries the counter
    right after its own add (who came before it) and the value that answered the wait."""
    core = StoreCore()
    assert _req(core, "add_wait_count", "v", 1, 3, None, 5.0, token="a") is None
    assert _req(core, "add_wait_count", "v", 1, 3, None, 5.0, token="b") is None
    assert core.take_answered() == []
    assert _req(core, "add_wait_count", "v", 1, 3, None, 5.0, token="c") == [OK, 3, 3]  # the last: at once
    assert sorted(core.take_answered()) == [("a", [OK, 3, 1]), ("b", [OK, 3, 2])]
    assert _req(core, "add_wait_count", "v", 1, 6, None, 1.0, now=1.0, token="d") is None
    assert _req(core, "add", "v", 1 << 40) == [OK, (1 << 40) + 4]  # a BIG ends it: the wait is answered
    assert core.take_answered() == [("d", [OK, (1 << 40) + 4, 4])]
    assert _req(core, "add_wait_count", "w", 1, 2, None, 1.0, now=1.0, token="e") is None
    core.expire(2.0)
    assert core.take_answered() == [("e", [TIMEOUT, 1, 1])]
    assert _req(core, "add_wait_count", "x", 1, 2, "stop", 0.0) == [TIMEOUT, 1, 1]
    _req(core, "set", "stop", b"why")
    assert _req(core, "add_wait_count", "x", 1, 9, "stop", 1.0) == [ABORT, b"why", 2]


def test_no_entry_count_cap():
    core = StoreCore()
    keys = [f"hello/{r}/1" for r in range(5000)]
    for k in keys:
        _req(core, "set", k, b"x" * 100)
    assert _req(core, "mget", keys)[1] == [b"x" * 100] * 5000


@pytest.fixture()
def transport():
    t = Transport(CFG, "rank0")
    yield t
    t.close()


def _store(transport, port=None):
    port = port or free_port()
    return StoreServer(transport, "127.0.0.1", port), port


@pytest.mark.parametrize("request_body", [["mget"], ["add", "k", math.inf], ["add", "k", 2**64 - 1],
                                          "not even a list"])
def test_the_store_survives_malformed_requests_from_a_job_member(transport, request_body):
    """Issue 13.7: ["mget"], ["add", "k", inf], ["add", "k", 2**64-1] each killed the store's
    thread, and every rank then timed out with 'is rank 0 running?'."""
    server, port = _store(transport)
    client = StoreClient(transport, "127.0.0.1", port, 10)
    raw = transport.dial(zmq.DEALER, f"tcp://127.0.0.1:{port}", "rank0")
    try:
        body = request_body if isinstance(request_body, str) else [client.incarnation, *request_body[1:]]
        method = request_body[0] if isinstance(request_body, list) else "set"
        raw.send(encode(Envelope(REQUEST, 1, method, body)))
        assert raw.poll(10_000)
        reply = decode(raw.recv(), 1 << 20)
        assert reply.kind != 1 and isinstance(reply.body, str), reply
        raw.send(msgpack.packb(["mget"]))  # the old store's own request format
        client.set("k", b"v")
        assert client.mget(["k", "nope"]) == [b"v", None]
        assert server.rejected == 2
    finally:
        raw.close(linger=0)
        client.close()
        server.close()


def test_wait_for_is_answered_by_the_store_and_names_what_is_missing(transport):
    server, port = _store(transport)
    a = StoreClient(transport, "127.0.0.1", port, 10)
    b = StoreClient(transport, "127.0.0.1", port, 10)
    got = []
    t = threading.Thread(target=lambda: got.append(wait_for(a, ["x", "y"], 30, "test")))
    try:
        t.start()
        b.set("y", b"2")
        b.set("x", b"1")
        t.join(30)
        assert got == [[b"1", b"2"]]
        with pytest.raises(RendezvousError, match=r"test: 1 key\(s\) still missing after 0.2s: never"):
            wait_for(b, ["x", "never"], 0.2, "test")
    finally:
        a.close()
        b.close()
        server.close()


def test_a_reinitialising_client_refuses_the_previous_store_until_it_is_replaced(transport):
    """Issue 13.4: a rank that re-initialises before rank 0 has replaced its store must not
    join the old one; it retries within its deadline and meets the new one."""
    old, port = _store(transport)
    first = StoreClient(transport, "127.0.0.1", port, 10)
    stale = StoreClient(transport, "127.0.0.1", port, 10)  # one that never noticed the re-init
    first.close()  # this process is done with incarnation `old`
    joined = []
    t = threading.Thread(target=lambda: joined.append(StoreClient(transport, "127.0.0.1", port, 30)))
    t.start()
    old.close()
    new, _ = _store(transport, port)
    t.join(40)
    try:
        assert joined and joined[0].incarnation == new.core.incarnation != old.core.incarnation
        with pytest.raises(RendezvousError, match="earlier init_process_group"):
            stale.set("k", b"v")  # a client of the old store: its requests are refused
    finally:
        stale.close()
        if joined:
            joined[0].close()
        new.close()


def test_4096_ranks_rendezvous_with_summarised_errors(transport):
    """Issue 12/13.18: the old store capped arrays at 1024 entries and made every rank poll
    every key; here 4096 ranks' hellos go through one store, a few ranks block in the store
    (no polling) while the rest join, and every rank reads the full table."""
    n = 4096
    server, port = _store(transport)
    clients = [StoreClient(transport, "127.0.0.1", port, 60) for _ in range(8)]
    info = {"config": "d", "backend": "zmq", "addr": ["tcp://127.0.0.1:40000"]}
    early = {}
    try:
        hellos = {r: rendezvous.join(clients[r % 4], r, n, {**info, "addr": [f"a{r}"]}, 60, "rdzv/")
                  for r in range(4)}
        threads = [threading.Thread(target=lambda r=r: early.__setitem__(
            r, rendezvous.gather(clients[r], hellos[r], n, 60, "rdzv/"))) for r in range(4)]
        for t in threads:
            t.start()
        for r in range(4, n):
            rendezvous.join(clients[4 + r % 4], r, n, {**info, "addr": [f"a{r}"]}, 60, "rdzv/")
        for t in threads:
            t.join(120)
        assert sorted(early) == [0, 1, 2, 3]
        for table in early.values():
            assert [row["addr"][0] for row in table] == [f"a{r}" for r in range(n)]
        last = rendezvous.gather(clients[5], {**info, "rank": n - 1, "world_size": n,
                                              "version": table[0]["version"]}, n, 60, "rdzv/")
        assert len(last) == n
        # a world where ranks 2..4095 never came: one readable line, the same for everyone
        rendezvous.join(clients[0], 0, n, info, 60, "short/")
        rendezvous.join(clients[1], 1, n, info, 60, "short/")
        with pytest.raises(RendezvousError) as err:
            rendezvous.gather(clients[0], {**info, "rank": 0}, n, 0.2, "short/")
        assert "4094 of 4096 ranks never joined within 0.2s (WORLD_SIZE 4096); missing: 2-4095" in str(err.value)
        with pytest.raises(RendezvousError, match="missing: 2-4095"):
            rendezvous.gather(clients[1], {**info, "rank": 1}, n, 30, "short/")
    finally:
        for c in clients:
            c.close()
        server.close()


def test_rank_ranges():
    from commrt.runtime.rendezvous import rank_ranges
    assert rank_ranges([]) == "" and rank_ranges([5]) == "5"
    assert rank_ranges([9, 2, 3, 4, 7, 8]) == "2-4, 7-9"


def test_a_huge_world_size_gets_the_real_cause(transport):
    """Issue 13.18: WORLD_SIZE=100000 got the misleading security hint (the old store refused
    arrays over 1024 entries, so the rank saw a store that 'did not answer')."""
    server, port = _store(transport)
    client = StoreClient(transport, "127.0.0.1", port, 30)
    try:
        hello = rendezvous.join(client, 0, 100_000, {"config": "d", "backend": "zmq"}, 30, "rdzv/")
        with pytest.raises(RendezvousError) as err:
            rendezvous.gather(client, hello, 100_000, 0.2, "rdzv/")
        msg = str(err.value)
        assert "99999 of 100000 ranks never joined within 0.2s (WORLD_SIZE 100000); missing: 1-99999" in msg
        assert "security" not in msg and len(msg) < 300
    finally:
        client.close()
        server.close()


@pytest.mark.parametrize("sizes", [(3, 2), (2, 3)])
def test_a_world_size_mismatch_in_exchange_fails_every_rank_at_once(store, sizes):
    """The gloo/nccl rendezvous (exchange): the rank that finds the mismatch aborts it for all,
    as meet does. The rank told the larger WORLD_SIZE waited out its timeout and blamed a rank
    that does not exist ("missing: 2")."""
    out, clients = {}, {r: store() for r in (0, 1)}

    def rank(r):
        try:
            rendezvous.exchange(clients[r], r, sizes[r], {"config": "d", "backend": "gloo"}, 20, "x/")
        except RendezvousError as exc:
            out[r] = str(exc)
    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert time.monotonic() - start < 10, out  # not the 20 s timeout
    assert len(out) == 2 and out[0] == out[1] and "world size" in out[0], out


@pytest.mark.parametrize("how", ["exchange", "meet"])
def test_a_stray_rank_of_a_larger_world_fails_every_rank(store, how):
    """World sizes 2, 2 and 3 given to ranks 0, 1 and 2: rank 2 alone failed, while ranks 0 and 1
    formed a world of 2 and went on (review revF had only stopped rank 2's early join from
    crashing gather with a TypeError). Every rank now fails with the same RendezvousError naming
    the world sizes: rank 0 decides, once every rank of its world joined, with the stray's hello
    (or its abort) in sight, and the others wait for its verdict."""
    clients, out = {r: store() for r in (2, 1, 0)}, {}
    info = {"config": "d", "backend": "gloo" if how == "exchange" else "zmq"}

    def rank(r, world_size):
        try:
            getattr(rendezvous, how)(clients[r], r, world_size, info, 20, "x/")
            out[r] = "formed a world"
        except RendezvousError as exc:
            out[r] = str(exc)
    stray = threading.Thread(target=rank, args=(2, 3))
    stray.start()  # published its hello and waits for rank 0's, as a process started first would
    assert wait_for(clients[0], ["x/rdzv/hello/2/1"], 10, "the stray's hello")
    threads = [threading.Thread(target=rank, args=(r, 2)) for r in (1, 0)]
    for t in threads:
        t.start()
    for t in [stray, *threads]:
        t.join(30)
    assert set(out) == {0, 1, 2}, out
    assert out[0] == out[1] == out[2] and "has world size 3, rank 0 has 2" in out[0] and "rank 2 (" in out[0], out


def test_waits_that_timed_out_do_not_pile_up_in_the_store():
    """Found in the hardening review (wtT4): a timed-out wait stayed in its key's index until the
    key arrived, so a client re-waiting in short slices for a key that never comes (a dead rank's
    address, groups.read_when_published: every 0.2 s) grew rank 0's store without bound."""
    core = StoreCore()
    for i in range(10_000):  # one second a slice: exact in floating point
        assert _req(core, "wait", ["never"], None, 1.0, now=float(i)) is None
        assert _req(core, "wait_count", "n", 5, None, 1.0, now=float(i)) is None
        core.expire(i + 1.0)
    assert len(core.take_answered()) == 20_000
    assert len(core._by_key["never"]) <= 128 and len(core._by_counter["n"]) <= 128
    assert _req(core, "wait", ["never"], None, 1.0, now=1e4, token="late") is None  # live ones still answer
    assert _req(core, "wait_count", "n", 1, None, 1.0, now=1e4, token="count") is None
    _req(core, "set", "never", b"!")
    _req(core, "add", "n", 1)
    assert core.take_answered() == [("late", [OK, [b"!"]]), ("count", [OK, 1])]


def test_meets_waits_share_one_deadline(store):
    """meet's waits (rank 0's hello, every rank joined, the layout) each took a whole timeout_s:
    rank 1 waiting for rank 0, which came just before the timeout, then waited a whole timeout
    more for rank 2, which never came. With one deadline it gives up at timeout_s."""
    timeout_s, out = 3.0, {}
    clients = {r: store() for r in (0, 1)}

    def rank(r, delay):
        time.sleep(delay)
        try:
            rendezvous.meet(clients[r], r, 3, {"config": "d", "backend": "zmq"}, timeout_s, "m/")
        except RendezvousError as exc:
            out[r] = (time.monotonic() - start, str(exc))
    start = time.monotonic()
    threads = [threading.Thread(target=rank, args=(0, 2.0)), threading.Thread(target=rank, args=(1, 0.0))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert set(out) == {0, 1} and all("missing: 2" in msg for _, msg in out.values()), out
    assert out[1][0] < timeout_s + 1.0, out  # its own deadline (3 s), not 2.0 + a whole timeout_s (5 s)


def test_a_reply_beyond_the_frame_limit_is_refused_before_it_is_built():
    """Review revF: mget and wait sent back every value asked for, and a key may be asked for
    any number of times: mget(["big"] * 20000) of a 1 MiB value (a 60 KB request) made the store's
    thread encode 20 GB; it ran 30 s and died of MemoryError (under a 3 GiB address-space limit),
    leaving every rank without a store. Such a request is refused up front, a parked wait is
    answered with the error when its keys arrive, and the set that completed it still succeeds."""
    core = StoreCore()
    _req(core, "set", "big", b"x" * MAX_VALUE)
    n = MAX_FRAME // MAX_VALUE + 1
    with pytest.raises(ProtocolError, match="frame limit"):
        _req(core, "mget", ["big"] * n)
    with pytest.raises(ProtocolError, match="frame limit"):
        _req(core, "wait", ["big"] * n, None, 10.0)
    assert _req(core, "wait", ["late"] * n, None, 10.0, token="w") is None
    assert _req(core, "set", "late", b"y" * MAX_VALUE) == [OK]
    [(token, reply)] = core.take_answered()
    assert token == "w" and isinstance(reply, ProtocolError) and "frame limit" in str(reply)
    assert _req(core, "mget", ["big"] * (n - 2))[0] == OK  # within the limit: answered as before
    _req(core, "add", "counter", 3)  # a counter's value is an int: mget and wait read it too
    assert _req(core, "mget", ["counter", "big", "none"]) == [OK, [3, b"x" * MAX_VALUE, None]]
    assert _req(core, "wait", ["counter"], None, 1.0) == [OK, [3]]
