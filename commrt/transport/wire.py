"""Wire format: a small versioned msgpack header followed by one raw payload frame.

A header is a fixed-position msgpack array (cheaper to encode and check than a map):

    [version, kind, group, seq, src, op, dtype, count, step, nbytes, reduce, root]

``op``/``dtype``/``count``/``reduce``/``root`` describe the whole collective so a receiver can
tell when two ranks disagree about what they are running (``CollectiveMismatch``) instead of
mixing up bytes: a rank running MAX against a SUM, or broadcasting from another root, is
caught (issue 13.5). Both ends are strict: ``encode_header`` refuses a header a receiver would
drop (a clear ``ValueError`` at the sender, issue 13.6), and ``decode_header`` range-checks
every field, per message kind, so nothing that cannot be a real message reaches an operation
(``ProtocolError``: the endpoint drops and counts it, issue 13.10). The payload is never
interpreted by a deserializer: it is raw bytes of a whitelisted dtype.
"""
from __future__ import annotations

import enum
import threading
from typing import NamedTuple

import msgpack

from commrt.runtime.errors import ProtocolError

VERSION = 4  # 2: reduce op and root joined the header; 3: bool (code 9), which a 2 drops; 4: REFUSE notices
MAX_HEADER_BYTES = 256
_FIELDS = 12
_INT_MAX = 1 << 62
MAX_TAG = _INT_MAX  # point-to-point tags are in [0, MAX_TAG)

# message kinds
COLL = 0  # part of a collective
P2P = 1  # point-to-point send/recv; ``op`` is the tag
P2P_SHM_ROOT = 1  # a P2P header's ``root``: its payload lies in the sender's shared-memory ring (transport/shm_p2p.py)
P2P_DOORBELL = 2  # an empty P2P message: look in the sender's mailbox (transport/mailbox.py)
ABORT = 2  # "I am giving up": rank <op> is lost (empty payload), or a mismatch report (payload)
# "rank <count> refused collective <op> at <seq>", sent by it (src == count) or passed on by a
# peer that had started the op and gave up (src != count); the payload is the reason, UTF-8
REFUSE = 3
MAX_REASON_BYTES = 1024


class Coll(enum.IntEnum):
    """Collective codes: the low 8 bits of a COLL header's ``op`` (the bits above are the
    24-bit call-site hash, or 0)."""
    ALL_REDUCE = 1
    REDUCE_SCATTER = 2
    ALL_GATHER = 3
    BROADCAST = 4
    REDUCE = 5
    ALL_TO_ALL = 6
    BARRIER = 7


# element size of each dtype code (commrt.runtime.dtypes maps the codes to torch dtypes; a unit test
# keeps the two tables equal). Codes are part of the wire format: never renumber.
ITEMSIZE = {1: 4, 2: 8, 3: 2, 4: 2, 5: 1, 6: 1, 7: 4, 8: 8, 9: 1}
# reduce op codes: the values of commrt.ReduceOp (SUM, AVG, PRODUCT, MIN, MAX)
REDUCE_CODES = range(5)
_COLLS = frozenset(int(c) for c in Coll)
_N_REDUCE = len(REDUCE_CODES)
_local = threading.local()


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
    reduce: int = 0  # COLL: the ReduceOp code (0 where the collective does not reduce)
    root: int = 0  # COLL: broadcast's source / reduce's destination group rank, else 0


def problem(h: Header) -> str | None:
    """What makes ``h`` impossible as a real message, or None. It runs twice per message (at
    encode and decode), so the common case is one combined test; ``_describe`` says what failed."""
    for v in h:  # a plain loop measured faster than set(map(type, h)) plus min() and max()
        if type(v) is not int or v < 0 or v >= _INT_MAX:
            return _describe(h)
    kind, _, _, _, op, dtype, _, step, nbytes, reduce, root = h
    if kind == COLL:
        size = ITEMSIZE.get(dtype)
        if size and not nbytes % size and op & 0xFF in _COLLS and not op >> 32 and reduce < _N_REDUCE:
            return None
    elif kind == P2P:
        size = ITEMSIZE.get(dtype)
        if size and not nbytes % size and reduce == 0 and root in (0, P2P_SHM_ROOT, P2P_DOORBELL):
            return None
    elif kind == ABORT and dtype == reduce == root == 0:  # the payload: empty, or a mismatch report
        return None
    elif kind == REFUSE and dtype == step == reduce == root == 0 and op in _COLLS and nbytes <= MAX_REASON_BYTES:
        return None
    return _describe(h)


def _describe(h: Header) -> str:
    for name, v in zip(Header._fields, h):
        if type(v) is not int or not 0 <= v < _INT_MAX:
            return f"header field {name}={v!r} is not an integer in [0, 2**62)"
    if h.kind == ABORT:
        return "an ABORT carries no dtype, reduce op or root"
    if h.kind == REFUSE:
        return (f"a REFUSE (kind {REFUSE}) names a collective code and carries no dtype, step, reduce op "
                f"or root, and a reason of at most {MAX_REASON_BYTES} bytes")
    if h.kind not in (COLL, P2P):
        return f"unknown message kind {h.kind}"
    size = ITEMSIZE.get(h.dtype)
    if size is None:
        return f"unknown dtype code {h.dtype}"
    if h.nbytes % size:
        return f"payload of {h.nbytes} bytes is not a whole number of {size}-byte elements"
    if h.kind == P2P:
        return "a point-to-point message has no reduce op or root"
    if h.reduce >= _N_REDUCE:
        return f"unknown reduce op code {h.reduce}"
    return f"unknown collective code {h.op & 0xFF} (op field {h.op})"


def encode_header(h: Header) -> bytes:
    """Pack ``h``; a ValueError names the field if a receiver would have to drop it."""
    why = problem(h)
    if why is not None:
        raise ValueError(f"refusing to send a malformed header ({why}): {h}")
    try:
        pack = _local.pack
    except AttributeError:  # one Packer per thread: packb builds a new one per call (~0.7 us)
        pack = _local.pack = msgpack.Packer(use_bin_type=True).pack
    return pack((VERSION, *h))


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
    if type(fields[0]) is not int or fields[0] != VERSION:
        raise ProtocolError(f"wire version {fields[0]!r} received, this build speaks {VERSION}")
    h = Header(*fields[1:])
    why = problem(h)
    if why is not None:
        raise ProtocolError(why)
    return h
