"""What an Endpoint hands its owner: a received message, and a peer's report of a mismatch."""
from __future__ import annotations

from typing import NamedTuple

import zmq

from commrt.runtime.errors import ProtocolError
from commrt.transport.wire import Header, decode_header, encode_header


class Message(NamedTuple):
    header: Header
    payload: zmq.Frame


class MismatchReport(Exception):
    """A peer reports a collective mismatch it saw: ``mine`` (the reporter's header) against
    ``theirs``. The backend restates it as a ``CollectiveMismatch`` against this rank's op."""

    def __init__(self, reporter: int, mine: Header, theirs: Header):
        self.reporter, self.mine, self.theirs = reporter, mine, theirs
        super().__init__(f"rank {reporter} reports a mismatch with rank {theirs.src}")


def encode_report(mine: Header, theirs: Header) -> bytes:
    a, b = encode_header(mine), encode_header(theirs)
    return bytes([len(a)]) + a + b


def decode_report(buf) -> tuple[Header, Header]:
    buf = bytes(buf)
    if not buf or len(buf) < 1 + buf[0]:
        raise ProtocolError("truncated mismatch report")
    return decode_header(buf[1:1 + buf[0]]), decode_header(buf[1 + buf[0]:])
