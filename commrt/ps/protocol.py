"""Parameter-server messages: a msgpack header frame, then raw tensor frames.

    request: [version, op, worker, step, req_id, body, nonce] + one frame per segment
    reply:   [version, status, req_id, body]                 + one frame per segment

``body`` is a short list whose shape depends on the op (checked here, field by field). An init
describes the parameters: ``[seed, [[name, start, stop, dtype], ...], [[name, [dims...]], ...]]``
(its segments on this server, then every tensor's full shape), which the server binds pushes to;
it is answered ``[version, clock, member, start]`` (ps/membership.py). A JOIN (empty body; its
step: where the worker starts) admits a late or dropped worker. ``nonce``: drawn by each client
process at start, so a shard tells two processes under one worker id apart (ps/incarnations.py).
Headers
are decoded with hard limits and no extension types; payload frames are never deserialised,
only reinterpreted as a whitelisted dtype after their byte count was checked.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import msgpack

from commrt.runtime.dtypes import NAMES as DTYPE_NAMES
from commrt.runtime.errors import ProtocolError

VERSION = 4  # 2: init carries full shapes; FAILED replies. 3: JOIN; init replies say membership.
# 4: every request carries its process's nonce
MAX_HEADER_BYTES = 4 << 20
MAX_SEGMENTS = 1 << 16
MAX_NAME = 1024
MAX_TEXT = 64 << 10  # a reply's message (an error naming workers or segments), within the header bound
MAX_DIMS = 64
_INT_MAX = 1 << 62

# ops
INIT, PUSH, PULL, PUSHPULL, PING, STATS, JOIN = 1, 2, 3, 4, 5, 6, 7
OP_NAMES = {INIT: "init", PUSH: "push", PULL: "pull", PUSHPULL: "push_pull", PING: "ping",
            STATS: "stats", JOIN: "join"}
# reply statuses (FAILED: the server hit an error it cannot serve past, e.g. a full disk, and stops)
OK, ERROR, PENDING, UNKNOWN, LOST, DUPLICATE, FAILED = 0, 1, 2, 3, 4, 5, 6
STATUSES = (OK, ERROR, PENDING, UNKNOWN, LOST, DUPLICATE, FAILED)


class Request(NamedTuple):
    op: int
    worker: int
    step: int
    req_id: int
    body: list
    nonce: int = 0


class Reply(NamedTuple):
    status: int
    req_id: int
    body: Any


def _no_ext(code: int, data: bytes):
    raise ProtocolError(f"msgpack extension type {code} is not allowed")


def _unpack(buf, max_map: int, max_str: int = MAX_NAME) -> Any:
    if len(buf) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(buf)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        return msgpack.unpackb(buf, raw=False, max_str_len=max_str, max_bin_len=0,
                               max_array_len=MAX_SEGMENTS, max_map_len=max_map, max_ext_len=0,
                               ext_hook=_no_ext, strict_map_key=True)
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types on bad input
        raise ProtocolError(f"undecodable header: {type(exc).__name__}: {exc}") from None


def _is_count(v: Any) -> bool:
    return type(v) is int and 0 <= v < _INT_MAX


def _check_ids(body: list) -> None:
    if not all(_is_count(i) for i in body):
        raise ProtocolError("segment ids must be non-negative integers")


def _check_init(body: list) -> None:
    if len(body) != 3 or type(body[0]) is not bool or not all(isinstance(b, list) for b in body[1:]):
        raise ProtocolError("init body must be [seed: bool, segments: list, shapes: list]")
    for entry in body[2]:
        if (not isinstance(entry, list) or len(entry) != 2 or not isinstance(entry[0], str)
                or not isinstance(entry[1], list) or len(entry[1]) > MAX_DIMS
                or not all(_is_count(d) for d in entry[1])):
            raise ProtocolError(f"bad shape description {entry!r}: expected [name, [dims...]]")
    for seg in body[1]:
        if (not isinstance(seg, list) or len(seg) != 4 or not isinstance(seg[0], str)
                or not all(_is_count(v) for v in seg[1:]) or seg[1] > seg[2]
                or seg[3] not in DTYPE_NAMES):
            raise ProtocolError(f"bad segment description {seg!r}: expected [name, start, stop, dtype]")


def encode_request(op: int, worker: int, step: int, req_id: int, body: list, nonce: int = 0) -> bytes:
    return msgpack.packb([VERSION, op, worker, step, req_id, body, nonce], use_bin_type=True)


def decode_request(buf) -> Request:
    msg = _unpack(buf, max_map=0)
    if isinstance(msg, list) and msg and msg[0] != VERSION:  # an older client: say so, not "malformed"
        raise ProtocolError(f"protocol version {msg[0]!r} received, this build speaks {VERSION}")
    if not isinstance(msg, list) or len(msg) != 7:
        raise ProtocolError("request must be [version, op, worker, step, req_id, body, nonce]")
    req = Request(*msg[1:])
    if type(req.op) is not int or req.op not in OP_NAMES:
        raise ProtocolError(f"unknown op {req.op!r}")
    if not all(_is_count(v) for v in (req.worker, req.step, req.req_id, req.nonce)) or not isinstance(req.body, list):
        raise ProtocolError("worker, step, req_id and nonce must be non-negative integers; body a list")
    if req.op == INIT:
        _check_init(req.body)
    elif req.op in (PUSH, PULL, PUSHPULL):
        _check_ids(req.body)
    elif req.body:
        raise ProtocolError(f"{OP_NAMES[req.op]} takes an empty body")
    return req


def encode_reply(status: int, req_id: int, body: Any) -> bytes:
    return msgpack.packb([VERSION, status, req_id, body], use_bin_type=True)


class Routed(NamedTuple):
    """A reply and the ROUTER identity it goes to."""
    ident: bytes
    frames: list


def routed(ident: bytes, status: int, req_id: int, body: Any, payload: list | None = None) -> Routed:
    if body and type(body) is list and type(body[0]) is str and len(body[0]) > MAX_TEXT:
        body = [clip(body[0]), *body[1:]]  # a message the client can read, whatever it names
    return Routed(ident, [encode_reply(status, req_id, body), *(payload or [])])


def clip(text: str, limit: int = MAX_TEXT) -> str:
    """``text`` cut to fit ``limit`` characters, saying how much was left out."""
    if len(text) <= limit:
        return text
    tail = f" ... ({len(text) - limit + 64} more characters)"
    return text[:limit - 64] + tail


def decode_reply(buf) -> Reply:
    """A server's answer. Its message may be longer than a request's names (an error naming two
    segment descriptions, or the missing workers): with the request's limit, a LOST or ERROR
    reply went unread and the client re-sent the request, for ever in a sync job."""
    msg = _unpack(buf, max_map=4096, max_str=MAX_TEXT)
    if not isinstance(msg, list) or len(msg) != 4 or msg[0] != VERSION:
        raise ProtocolError("reply must be [version, status, req_id, body]")
    if type(msg[1]) is not int or msg[1] not in STATUSES or not _is_count(msg[2]):
        raise ProtocolError(f"bad reply status/id {msg[1:3]!r}")
    return Reply(*msg[1:])


# what an answer's body holds, per op, when it is OK (or DUPLICATE): a predicate per field
_ANSWERS = {
    INIT: (_is_count, _is_count, lambda v: type(v) is bool, _is_count),  # version, clock, member, start
    JOIN: (_is_count, _is_count),  # version, clock
    PUSH: (_is_count,),  # version
    PULL: (_is_count, lambda v: isinstance(v, list) and all(_is_count(i) for i in v)),  # version, ids
}
_ANSWERS[PUSHPULL] = _ANSWERS[PULL]


def check_reply(op: int, reply: Reply) -> None:
    """Check that the body of a reply to ``op`` holds what its status promises, so that a
    buggy or foreign server is a ProtocolError, not an IndexError deep in the client."""
    body, status = reply.body, reply.status
    if status in (ERROR, FAILED):
        ok = isinstance(body, list) and len(body) >= 1 and isinstance(body[0], str)
    elif status == LOST:
        ok = (isinstance(body, list) and len(body) == 2 and isinstance(body[0], str)
              and isinstance(body[1], list) and all(_is_count(w) for w in body[1]))
    elif status in (OK, DUPLICATE) and op == STATS:
        ok = isinstance(body, dict)
    elif status in (OK, DUPLICATE) and op in _ANSWERS:
        fields = _ANSWERS[op]
        ok = isinstance(body, list) and len(body) == len(fields) and all(f(v) for f, v in zip(fields, body))
    else:
        ok = status in (PENDING, UNKNOWN)
    if not ok:
        raise ProtocolError(f"a {OP_NAMES.get(op, op)} answered with status {status} and body {body!r:.200}")
