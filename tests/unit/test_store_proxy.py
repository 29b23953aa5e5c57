"""A store per node (issue 32.5, store_proxy.py): the pure decisions, then a real store, proxy
and clients over loopback and abstract Unix sockets, in one process: waits forwarded
concurrently over one upstream connection, and typed errors (never a hang) when the store, or
the proxy, is gone or silent."""
import hashlib
import math
import os
import re
import subprocess
import sys
import threading
import time

import pytest
import zmq

from commrt.launch import free_port
from commrt.runtime.config import load_config
from commrt.runtime.errors import RendezvousError
from commrt.runtime.store import StoreServer
from commrt.runtime.store_core import OK
from commrt.runtime import store_proxy
from commrt.runtime.store_proxy import CLIENT_SHARE, connect, forward_deadline, proxy_name, use_proxy
from commrt.transport.rpc import RpcClient, RpcRejected
from commrt.transport.transport import Transport

CFG = load_config(overrides={"security": {"mode": "none"}, "comm": {"timeout_s": 20}}, environ={})
NODE1 = [[1, 0, 2], [1, 1, 2]]  # node 1's two ranks (ranks 2 and 3 of 2 nodes x 2): leader first


@pytest.mark.parametrize("enabled,backend,hint,world,agent,expect", [
    (True, "zmq", [1, 0, 4], 8, False, True),
    (False, "zmq", [1, 0, 4], 8, False, False),   # turned off in the config
    (True, "gloo", [1, 0, 4], 8, False, False),   # gloo/nccl: unchanged
    (True, "zmq", None, 8, False, False),         # no node hints
    (True, "zmq", [0, 0, 8], 8, False, False),    # one node
    (True, "zmq", [1, 0, 4], 8, True, False),     # torchrun's agent serves the store
])
def test_proxies_are_used_only_where_safe(enabled, backend, hint, world, agent, expect):
    assert use_proxy(enabled, backend, hint, world, agent) is expect


def test_a_forwarded_request_keeps_its_own_wait_and_most_of_the_timeout():
    assert forward_deadline("add", [7, "k", 1], 100.0, 20.0) == 100.0 + CLIENT_SHARE * 20
    assert forward_deadline("wait", [7, ["k"], None, 30], 100.0, 20.0) == 130.0 + CLIENT_SHARE * 20
    assert forward_deadline("add_wait_count", [7, "k", 1, 4, None, 2.5], 0.0, 20.0) == 2.5 + CLIENT_SHARE * 20
    for bad in (math.nan, -1, 1e9, True, "5", None):  # the store refuses these at once
        assert forward_deadline("wait_count", [7, "k", 1, None, bad], 0.0, 20.0) == CLIENT_SHARE * 20


def test_the_proxy_name_needs_the_job_secret():
    names = {proxy_name(s, "127.0.0.1", 2900, n) for s in (b"a" * 16, b"b" * 16) for n in (1, 2)}
    assert len(names) == 4 and all(len(n) < 100 for n in names)
    assert proxy_name(b"a" * 16, "127.0.0.1", 2900, 1) == proxy_name(b"a" * 16, "127.0.0.1", 2900, 1)


def test_the_proxy_name_is_no_fast_hash_of_the_secret_and_every_process_derives_the_same():
    """Every local user can list abstract socket names (/proc/net/unix): one SHA-256 of the secret
    and the public host, port and node let them test guesses at a chosen secret offline."""
    secret, where = b"our-team-secret-2024", ("10.0.0.1", 29500, 1)
    name = proxy_name(secret, *where)
    fast = hashlib.sha256(b"|".join([secret, b"10.0.0.1", b"29500", b"1"])).hexdigest()[:24]
    assert name.startswith("commrt-store-") and name != f"commrt-store-{fast}"
    code = f"from commrt.runtime.store_proxy import proxy_name; print(proxy_name({secret!r}, *{where!r}))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert other.stdout.strip() == name, other.stderr
    assert proxy_name(secret + b"!", *where) != name


@pytest.fixture()
def transport():
    t = Transport(CFG, "rank2")
    yield t
    t.close()


def _park(client, timeout_s: float):
    """A wait that nothing will satisfy, parked in a thread through ``client``: (the thread, the
    list its RendezvousError's text lands in), once the wait has had time to reach the store."""
    got = []

    def parked():
        try:
            client.wait(["never"], None, timeout_s)
        except RendezvousError as exc:
            got.append(str(exc))
    waiter = threading.Thread(target=parked)
    waiter.start()
    time.sleep(0.3)
    return waiter, got


def _node(transport, port, timeout_s=20.0):
    """Node 1's leader (rank 2, serving the proxy) and rank 3, both through the proxy."""
    (lead, proxy), (other, none) = (connect(transport, "127.0.0.1", port, 2 + h[1], timeout_s, h) for h in NODE1)
    assert proxy is not None and none is None and lead.via and other.via
    return proxy, lead, other


def test_waits_go_on_concurrently_over_one_upstream_connection(transport):
    port = free_port()
    server = StoreServer(transport, "127.0.0.1", port)
    proxy, lead, other = _node(transport, port)
    try:
        got = []
        waiter = threading.Thread(target=lambda: got.append(lead.wait(["k"], None, 10.0)))
        waiter.start()
        time.sleep(0.3)  # the wait is parked in the store by now
        assert other.wait_count("c", 0, None, 5.0)[0] == OK  # not behind the parked wait
        other.set("k", b"v")
        waiter.join(10)
        assert got == [[OK, [b"v"]]]
        assert other.add_wait_count("n", 1, 1, None, 5.0) == [OK, 1, 1]
        assert server.connections == 1 and proxy.stats()["clients"] == 2  # one upstream for the node
    finally:
        lead.close(), other.close(), proxy.close(), server.close()


def test_a_proxy_whose_store_is_gone_fails_its_calls_naming_store_and_op(transport):
    port = free_port()
    server = StoreServer(transport, "127.0.0.1", port)
    proxy, lead, other = _node(transport, port)
    try:
        waiter, got = _park(lead, 60.0)
        start = time.monotonic()
        server.close()  # rank 0 exits: the proxy's connection drops
        waiter.join(30)
        assert not waiter.is_alive() and time.monotonic() - start < 10, "the parked wait was not failed"
        assert f"rendezvous store at 127.0.0.1:{port}" in got[0] and "(wait)" in got[0], got
        assert "store proxy of node 1 on rank 2" in got[0], got
        with pytest.raises(RendezvousError, match=r"lost its connection .*\(add\)"):
            other.add("k", 1)  # at once, not at the deadline
    finally:
        lead.close(), other.close(), proxy.close()


def test_a_silent_store_is_answered_at_the_proxys_deadline(transport):
    """An upstream that never answers: the proxy answers first, naming the op."""
    port = free_port()
    silent, _ = transport.listen(zmq.ROUTER, "127.0.0.1", port)
    proxy = store_proxy.StoreProxy(transport, "127.0.0.1", port, 1, 2, 1.0)
    rpc = RpcClient(transport, proxy.address, "rank2", max_frame=1 << 20)
    try:
        start = time.monotonic()
        with pytest.raises(RpcRejected, match=r"did not answer add in time .*store proxy of node 1 on rank 2"):
            rpc.call("add", [1, "k", 1], 5.0)
        assert time.monotonic() - start < 3.0
    finally:
        rpc.close()
        proxy.close()
        silent.close(linger=0)


def test_ranks_whose_proxy_is_gone_fail_with_a_typed_error_within_a_heartbeat(transport):
    """The node's leader dies: a wait parked through its proxy and a call made afterwards both
    fail within about a heartbeat interval (1 s here), far inside their 20 s deadline."""
    port = free_port()
    server = StoreServer(transport, "127.0.0.1", port)
    proxy, lead, other = _node(transport, port, timeout_s=20.0)
    try:
        assert other.add("k", 1) == 1
        waiter, got = _park(lead, 20.0)
        start = time.monotonic()
        proxy.close()  # the node's leader died
        waiter.join(30)
        assert not waiter.is_alive() and time.monotonic() - start < 5.0, "the parked wait waited out its deadline"
        assert re.search(r"via the store proxy of node 1 on rank 2 lost its connection .*\(wait\): the store proxy "
                         r"of node 1 on rank 2 exited", got[0]), got
        start = time.monotonic()
        with pytest.raises(RendezvousError, match=r"via the store proxy of node 1 on rank 2 lost its connection "
                                                  r".*\(add\)"):
            other.add("k", 1)
        assert time.monotonic() - start < 5.0
    finally:
        lead.close(), other.close(), server.close()


def test_a_rank_without_a_proxy_on_its_node_dials_the_store_itself(transport, monkeypatch):
    """Its leader is late or serves none (its [cluster] store_proxy says false): after ABSENT_S
    the rank reaches the store directly, where the rendezvous compares configs."""
    monkeypatch.setattr(store_proxy, "ABSENT_S", 0.5)
    port = free_port()
    server = StoreServer(transport, "127.0.0.1", port)
    start = time.monotonic()
    client, proxy = connect(transport, "127.0.0.1", port, 3, 20.0, NODE1[1])
    try:
        assert proxy is None and client.via == "" and time.monotonic() - start < 10.0
        assert client.add("k", 1) == 1 and server.connections == 1
    finally:
        client.close(), server.close()
