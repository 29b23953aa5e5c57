"""The request/reply channel (transport/rpc.py): the pure envelope codec (round trip, fuzz) and
a real client and server over loopback sockets."""
import random
import threading

import msgpack
import pytest
import zmq

from commrt.runtime.config import load_config
from commrt.runtime.errors import ProtocolError
from commrt.transport.transport import Transport
from commrt.transport.rpc import (DEFER, ERROR, MAX_REQ_ID, REPLY, REQUEST, Envelope, RpcClient, RpcRejected,
    RpcServer, RpcTimeout, decode, encode)

CFG = load_config(overrides={"security": {"mode": "none"}, "comm": {"timeout_s": 10}}, environ={})


@pytest.mark.parametrize("env", [
    Envelope(REQUEST, 0, "set", ["k", b"v"]), Envelope(REPLY, MAX_REQ_ID, "", None),
    Envelope(ERROR, 7, "mget", "bad"), Envelope(REQUEST, 1, "x" * 64, {"a": [1, 2.5, None, True]}),
])
def test_envelope_round_trip(env):
    assert decode(encode(env), 1 << 20) == env


@pytest.mark.parametrize("msg,needle", [
    ([1, 0, -1, "m", None], "request id"), ([1, 0, 1 << 63, "m", None], "request id"),
    ([1, 0, True, "m", None], "request id"), ([1, 0, 1.0, "m", None], "request id"),
    ([2, 0, 1, "m", None], "version"), ([1, 5, 1, "m", None], "kind"), ([1, True, 1, "m", None], "kind"),
    ([1, 0, 1, b"m", None], "method"), ([1, 0, 1, "m" * 65, None], "method"),
    ([1, 0, 1, "m"], "must be"), ({"a": 1}, "must be"), (7, "must be"),
])
def test_malformed_envelopes_are_protocol_errors(msg, needle):
    with pytest.raises(ProtocolError, match=needle):
        decode(msgpack.packb(msg, use_bin_type=True), 1 << 20)


def test_oversized_and_extension_types_are_refused():
    with pytest.raises(ProtocolError, match="exceeds"):
        decode(encode(Envelope(REQUEST, 1, "m", b"x" * 100)), 64)
    with pytest.raises(ProtocolError, match="undecodable"):
        decode(msgpack.packb([1, 0, 1, "m", msgpack.ExtType(1, b"x")]), 1 << 20)


def test_fuzzed_envelopes_raise_only_protocol_errors():
    rng = random.Random(1)
    good = encode(Envelope(REQUEST, 12345, "wait_count", ["k", 4, None, 1.5]))
    for _ in range(20000):
        buf = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            op = rng.random()
            if op < 0.5 and buf:
                buf[rng.randrange(len(buf))] = rng.randrange(256)
            elif op < 0.75:
                del buf[rng.randrange(len(buf) + 1):]
            else:
                buf += bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        try:
            env = decode(bytes(buf), 1 << 16)
        except ProtocolError:
            continue
        assert env.kind in (REQUEST, REPLY, ERROR) and 0 <= env.req_id <= MAX_REQ_ID


@pytest.fixture()
def transport():
    t = Transport(CFG, "rank0")
    yield t
    t.close()


def _serve(transport, handler, **kw):
    return RpcServer(transport, "127.0.0.1", 0, handler, name="test", max_frame=1 << 20, **kw)


def test_a_failing_handler_answers_with_an_error_and_the_server_lives_on(transport):
    def handler(call):
        if call.method == "boom":
            raise IndexError("list index out of range")
        return ["echo", call.body]
    server = _serve(transport, handler)
    client = RpcClient(transport, server.address, "rank0", max_frame=1 << 20)
    try:
        with pytest.raises(RpcRejected, match="IndexError: list index out of range"):
            client.call("boom", [], 5)
        assert client.call("echo", [1, b"x"], 5) == ["echo", [1, b"x"]]
        raw = transport.ctx.socket(zmq.DEALER)  # garbage that is not even an envelope
        raw.connect(server.address)
        raw.send_multipart([b"\xc1garbage"])
        assert raw.poll(5000) and decode(raw.recv(), 1 << 20).kind == ERROR
        raw.close(linger=0)
        assert client.call("echo", 2, 5) == ["echo", 2] and server.rejected == 2
    finally:
        client.close()
        assert server.close()


def test_a_late_reply_never_answers_the_next_call(transport):
    """The first call times out; its reply arrives later and must be dropped, not returned as
    the answer to the second call (the old store client had no request ids)."""
    parked = []
    release = threading.Event()

    def handler(call):
        if call.method == "slow":
            parked.append(call)
            release.set()
            return DEFER
        return ["fast", call.body]
    server = _serve(transport, handler)
    client = RpcClient(transport, server.address, "rank0", max_frame=1 << 20)
    try:
        with pytest.raises(RpcTimeout, match="did not answer"):
            client.call("slow", 1, 0.3)
        assert release.wait(10)
        parked[0].reply(["slow", "late"])  # from another thread: queued, sent by the server thread
        assert client.call("fast", 2, 10) == ["fast", 2]
        assert client.discarded == 1
    finally:
        client.close()
        assert server.close()


def test_a_call_to_nobody_times_out_at_send_or_reply(transport):
    client = RpcClient(transport, "tcp://127.0.0.1:9", "rank0", max_frame=1 << 20)
    try:
        with pytest.raises(RpcTimeout) as info:
            client.call("x", None, 0.3)
        assert info.value.phase in ("send", "reply")
    finally:
        client.close()


def test_a_reply_that_cannot_be_encoded_is_an_error_reply_and_the_server_lives_on(transport):
    """Review revF: the handler's failures were answered, but a value it returned that msgpack
    cannot encode (a handler's bug, or a reply too large for memory: the store's MemoryError)
    raised in RpcServer.reply, outside that guard, and ended the serving thread: every later call
    timed out ('did not answer')."""
    def handler(call):
        return object() if call.method == "bad" else ["echo", call.body]
    server = _serve(transport, handler)
    client = RpcClient(transport, server.address, "rank0", max_frame=1 << 20)
    try:
        with pytest.raises(RpcRejected, match="could not be encoded"):
            client.call("bad", [], 5)
        assert client.call("echo", 1, 5) == ["echo", 1]
    finally:
        client.close()
        assert server.close()
