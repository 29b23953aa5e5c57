"""Closing an endpoint delivers what it queued: a group destroyed (or a process leaving) right
after its last send must not lose that message, whether or not the connection had finished its
handshake. Real sockets, two Transports (two ZeroMQ contexts, as two processes would have)."""
from __future__ import annotations

import pytest

from commrt.runtime.config import load_config
from commrt.transport.security import new_secret
from commrt.transport import Endpoint, Transport
from commrt.transport.wire import P2P, Header

ROUNDS = 20  # the unfixed close lost the message in nearly every round, not once in many


@pytest.mark.parametrize("mode", ["none", "secret"])
def test_a_message_sent_just_before_close_arrives(mode, monkeypatch):
    monkeypatch.setenv("COMMRT_JOB_SECRET", new_secret())
    cfg = load_config(None, {"comm": {"backend": "zmq"}, "security": {"mode": mode}})
    names = ["rank0", "rank1"]
    sender_side, receiver_side = Transport(cfg, "rank0"), Transport(cfg, "rank1")
    receiver = Endpoint(receiver_side, 0, 1, names, "127.0.0.1", "", 1 << 20, 3.0, 10.0)
    try:
        for i in range(ROUNDS):
            sender = Endpoint(sender_side, 0, 0, names, "127.0.0.1", "", 1 << 20, 3.0, 10.0)
            sender.connect({0: sender.address, 1: receiver.address})
            receiver.connect({0: sender.address, 1: receiver.address})
            sender.send(1, Header(P2P, 0, i, 0, 7, 1, 4, 0, 4), i.to_bytes(4, "little"), op="send")
            sender.close()  # at once: the connection is most likely still in its handshake
            msg = receiver.recv(0, tag=7, op="recv", seq=i, timeout_s=10.0)
            assert (msg.header.seq, int.from_bytes(msg.payload.bytes, "little")) == (i, i)
            receiver.close()  # its socket to the closed sender: a fresh one for the next round
            receiver = Endpoint(receiver_side, 0, 1, names, "127.0.0.1", "", 1 << 20, 3.0, 10.0)
    finally:
        receiver.close()
        sender_side.close()
        receiver_side.close()
