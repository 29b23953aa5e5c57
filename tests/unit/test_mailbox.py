"""The shared-memory mailbox of small point-to-point messages (transport/mailbox.py), both ends
over one buffer as the pair's segment would hold them: when a message may use it, records
round trip in order across the wrap, a full mailbox sends to the socket, and a record a peer
could forge is a ProtocolError, never an index used as is."""
from __future__ import annotations

import struct

import numpy as np
import pytest

from commrt.runtime.errors import ProtocolError
from commrt.transport import mailbox
from commrt.transport.mailbox import MAILBOX_BYTES, W_MHEAD, W_MTAIL, W_SPIN, Inbox, Outbox
from commrt.transport.wire import P2P, Header


def pair(spinning: bool = True):
    ctl = memoryview(bytearray(8192)).cast("q")
    box = memoryview(bytearray(MAILBOX_BYTES))
    out, inbox = Outbox(ctl, box), Inbox(3, ctl, box)
    inbox.spin(spinning)
    return out, inbox, ctl, box


def msg(seq: int, n: int, src: int = 3, tag: int = 7):
    payload = ((np.arange(n) + seq) % 256).astype(np.uint8)
    return Header(P2P, 0, seq, src, tag, 6, n, 0, n), payload


def test_records_round_trip_in_order_across_the_wrap():
    out, inbox, ctl, _ = pair()
    sent = []
    for seq in range(1, 400):  # ~40 KiB a round: the mailbox wraps several times
        n = (seq * 977) % 9000
        h, p = msg(seq, n)
        assert out.try_put(h, p) is True
        sent.append((h, bytes(p)))
        if seq % 20 == 0:
            got = inbox.take()
            assert [(m.header, m.payload.buffer) for m in got] == sent
            sent = []
            assert ctl[W_MTAIL] == ctl[W_MHEAD]
    assert [(m.header, m.payload.buffer) for m in inbox.take()] == sent
    assert out.head > 3 * MAILBOX_BYTES


def test_a_full_mailbox_or_a_receiver_that_does_not_wait_sends_to_the_socket():
    out, inbox, _, _ = pair(spinning=False)
    assert out.try_put(*msg(1, 100)) is None  # rule 1: nobody spins on it
    inbox.spin(True)
    out.sock_sent = 1  # rule 2: a socket message it has not read yet would be overtaken
    assert out.try_put(*msg(1, 100)) is None
    inbox.socket_read()
    assert out.try_put(*msg(1, 100)) is True
    n = 0
    while out.try_put(*msg(2, 30000)) is not None:
        n += 1
    assert 0 < n <= MAILBOX_BYTES // 30000  # full: the socket takes it, nothing was overwritten
    assert len(inbox.take()) == n + 1
    assert out.try_put(*msg(3, 30000)) is True  # room again once taken


def test_a_receiver_that_stopped_spinning_as_the_record_landed_gets_a_doorbell():
    out, inbox, ctl, _ = pair()
    ctl_spin = ctl[W_SPIN]
    assert ctl_spin == 1
    real = mailbox.barrier

    def stop_meanwhile():  # the receiver clears its flag between the sender's publish and look
        inbox.spin(False)
        real()
    mailbox.barrier = stop_meanwhile
    try:
        assert out.try_put(*msg(1, 10)) is False  # the caller rings the doorbell
    finally:
        mailbox.barrier = real
    assert [m.header.seq for m in inbox.take()] == [1]


@pytest.mark.parametrize("forge", ["size not aligned", "size past the end", "header too long",
                                   "another sender", "head far ahead", "wrap past head"])
def test_a_forged_record_is_a_protocol_error(forge):
    out, inbox, ctl, box = pair()
    assert out.try_put(*msg(1, 64)) is True
    if forge == "size not aligned":
        struct.pack_into("<II", box, 0, 77, 20)
    elif forge == "size past the end":
        struct.pack_into("<II", box, 0, MAILBOX_BYTES + 8, 20)
    elif forge == "header too long":
        struct.pack_into("<II", box, 0, 1024, 1000)
        ctl[W_MHEAD] = 1024
    elif forge == "another sender":
        out2, _, _, _ = pair()
        out2._ctl, out2._box, out2.head = ctl, box, 0
        ctl[W_MHEAD] = 0
        assert out2.try_put(*msg(1, 64, src=4)) is True
    elif forge == "head far ahead":
        ctl[W_MHEAD] = 10 * MAILBOX_BYTES
    elif forge == "wrap past head":
        struct.pack_into("<II", box, 0, mailbox.WRAP, 0)
    with pytest.raises(ProtocolError):
        inbox.take()
