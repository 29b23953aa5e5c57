"""Wire format: a small versioned msgpack header followed by one raw payload frame.

A header is a fixed-position msgpack array (cheaper to encode and check than a map):

    [version, kind, group, seq, src, op, dtype, count, step, nbytes]

``op``/``dtype``/``count`` describe the whole collective so a receiver can tell when two ranks
disagree about what they are running (``CollectiveMismatch``) instead of mixing up bytes.
Decoding is strict: bounded size, no extension types, every field range-checked. The payload
is never interpreted by a deserializer: it is raw bytes of a whitelisted dtype.
"""
from __future__ import annotations

from typing import NamedTuple

import msgpack

from .errors import ProtocolError

VERSION = 1
MAX_HEADER_BYTES = 256
_FIELDS = 10
_INT_MAX = 1 << 62

# message kinds
COLL = 0  # part of a collective
P2P = 1  # point-to-point send/recv
ABORT = 2  # "I am giving up because rank <op> is lost" (empty payload), so every survivor names it


class Header(NamedTuple):
    kind: int
    group: int
    seq: int
    src: int
    op: int
    dtype: int
    count: int
    step: int
    nbytes: int


def encode_header(h: Header) -> bytes:
    return msgpack.packb((VERSION, *h), use_bin_type=True)


def _no_ext(code: int, data: bytes):
    raise ProtocolError(f"msgpack extension type {code} is not allowed in a header")


def decode_header(buf: bytes | memoryview) -> Header:
    """Parse and validate a header; raises ProtocolError on anything unexpected."""
    if len(buf) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(buf)} bytes exceeds the {MAX_HEADER_BYTES}-byte limit")
    try:
        fields = msgpack.unpackb(
            buf, raw=True, max_str_len=0, max_bin_len=0, max_array_len=_FIELDS,
            max_map_len=0, max_ext_len=0, ext_hook=_no_ext, use_list=True,
        )
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types on bad input
        raise ProtocolError(f"undecodable header: {type(exc).__name__}: {exc}") from None
    if not isinstance(fields, list) or len(fields) != _FIELDS:
        raise ProtocolError(f"header must be an array of {_FIELDS} integers, got {type(fields).__name__}")
    for value in fields:
        if type(value) is not int or not 0 <= value < _INT_MAX:
            raise ProtocolError(f"header field {value!r} is not a non-negative integer")
    if fields[0] != VERSION:
        raise ProtocolError(f"wire version {fields[0]} received, this build speaks {VERSION}")
    h = Header(*fields[1:])
    if h.kind not in (COLL, P2P, ABORT):
        raise ProtocolError(f"unknown message kind {h.kind}")
    return h
