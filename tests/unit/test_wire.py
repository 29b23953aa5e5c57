import random

import msgpack
import pytest
import torch

from commrt import ReduceOp
from commrt.runtime import dtypes
from commrt.runtime.errors import ProtocolError
from commrt.transport.wire import (ABORT, COLL, ITEMSIZE, MAX_REASON_BYTES, MAX_TAG, P2P, REDUCE_CODES, REFUSE,
                                  VERSION, Coll, Header, decode_header, encode_header)

GOOD = Header(COLL, 3, 1 << 40, 2, int(Coll.REDUCE) | 0xABCDEF << 8, 4, 123456789, 7, 1 << 20,
              int(ReduceOp.MAX), 3)


def test_round_trip():
    assert decode_header(encode_header(GOOD)) == GOOD
    for h in (Header(P2P, 0, 0, 0, 0, 1, 0, 0, 0), Header(P2P, 0, 1, 1, MAX_TAG - 1, 8, 3, 0, 24),
              Header(ABORT, 2, 9, 1, 3, 0, 0, 0, 0), Header(ABORT, 2, 9, 1, 0, 0, 0, 0, 60),  # a report
              Header(COLL, 0, 1, 0, int(Coll.BARRIER), 6, 0, 0, 0)):
        assert decode_header(encode_header(h)) == h
    assert len(encode_header(GOOD)) < 64


def test_tables_agree_with_the_layers_above():
    """The wire's dtype/collective/reduce codes are the ones commrt.runtime.dtypes and ReduceOp use."""
    assert {c: torch.empty(0, dtype=dtypes.BY_NAME[n]).element_size() for c, n in dtypes.NAMES.items()} == ITEMSIZE
    assert {c: dtypes.NUMPY[n].itemsize for c, n in dtypes.NAMES.items() if n in dtypes.NUMPY} == {
        c: s for c, s in ITEMSIZE.items() if dtypes.NAMES[c] != "bfloat16"}
    assert sorted(int(op) for op in ReduceOp) == list(REDUCE_CODES)


def _raw(*fields):
    return msgpack.packb([VERSION, *fields])


@pytest.mark.parametrize("bad", [
    b"", b"\x00", b"\xff" * 10, msgpack.packb([VERSION + 1] + [0] * 11),
    msgpack.packb([VERSION - 1] + list(GOOD)[:9]),                 # the previous version
    _raw(0, 0, 0, 0, 1, 1, 0, 0, 0, 0),                            # too short
    _raw(0, 0, 0, -1, 1, 1, 0, 0, 0, 0, 0),                        # negative
    _raw(9, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0),                         # unknown kind
    _raw(0, 0, 0, "x", 1, 1, 0, 0, 0, 0, 0),                       # a string
    msgpack.packb({"v": 1}), _raw(*GOOD, 0),                       # a map; too long
    _raw(0, 0, 0, 0, 1, 1, 0, 0, 1.5, 0, 0),
    _raw(0, 0, 0, 0, 1, 1, 0, 0, msgpack.ExtType(1, b"x"), 0, 0),
    _raw(0, 0, 0, 0, 1, 1, 0, 0, True, 0, 0),
    _raw(0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 1 << 62),                   # out of range
    msgpack.packb([True, *GOOD]),                                  # version as a bool
    b"\x9c" + b"\xcf" + b"\xff" * 8,                               # truncated
    b"\x91" * 300,                                                 # oversized/nested
])
def test_malformed_headers_are_protocol_errors(bad):
    with pytest.raises(ProtocolError):
        decode_header(bad)


# well-formed msgpack, impossible as a message: each must be dropped at decode (issue 13.10),
# never reach an operation, and the sender must refuse to build it (issue 13.6)
IMPOSSIBLE = {
    "unknown dtype code": GOOD._replace(dtype=10),
    "dtype code 0": GOOD._replace(dtype=0),
    "unknown collective": GOOD._replace(op=8),
    "collective code 0": GOOD._replace(op=0xAB << 8),
    "op beyond site bits": GOOD._replace(op=int(Coll.ALL_REDUCE) | 1 << 32),
    "unknown reduce op": GOOD._replace(reduce=5),
    "partial element": GOOD._replace(dtype=1, nbytes=6),
    "p2p with a reduce op": Header(P2P, 0, 1, 1, 7, 1, 1, 0, 4, reduce=1),
    "p2p with a root": Header(P2P, 0, 1, 1, 7, 1, 1, 0, 4, root=3),  # 1: in a ring, 2: a doorbell
    "p2p unknown dtype": Header(P2P, 0, 1, 1, 7, 99, 1, 0, 4),
    "abort with dtype": Header(ABORT, 0, 1, 1, 2, 1, 0, 0, 0),
    "abort with a reduce op": Header(ABORT, 0, 1, 1, 2, 0, 0, 0, 0, reduce=1),
    "refuse with a dtype": Header(REFUSE, 0, 3, 1, int(Coll.ALL_REDUCE), 1, 1, 0, 10),
    "refuse of no collective": Header(REFUSE, 0, 3, 1, 0, 0, 1, 0, 10),
    "refuse with a call site": Header(REFUSE, 0, 3, 1, int(Coll.ALL_REDUCE) | 5 << 8, 0, 1, 0, 10),
    "refuse with a step": Header(REFUSE, 0, 3, 1, int(Coll.BARRIER), 0, 1, 2, 10),
    "refuse with a long reason": Header(REFUSE, 0, 3, 1, int(Coll.BARRIER), 0, 1, 0, MAX_REASON_BYTES + 1),
}


def test_a_refusal_round_trips():
    """REFUSE (rank <count> refused collective <op> at <seq>; the reason is the payload)."""
    h = Header(REFUSE, 2, 7, 1, int(Coll.ALL_GATHER), 0, 1, 0, MAX_REASON_BYTES)
    assert decode_header(encode_header(h)) == h


@pytest.mark.parametrize("what", sorted(IMPOSSIBLE))
def test_impossible_headers_are_dropped_at_decode(what):
    h = IMPOSSIBLE[what]
    with pytest.raises(ProtocolError):
        decode_header(msgpack.packb([VERSION, *h]))


@pytest.mark.parametrize("what", sorted(IMPOSSIBLE))
def test_impossible_headers_are_refused_at_encode(what):
    with pytest.raises(ValueError, match="refusing to send"):
        encode_header(IMPOSSIBLE[what])


@pytest.mark.parametrize("field,value", [
    ("op", MAX_TAG), ("seq", -1), ("count", 1 << 64), ("step", 1.0), ("nbytes", True),
    ("root", None), ("group", "0"), ("kind", 3),
])
def test_encode_names_the_bad_field(field, value):
    h = Header(P2P, 0, 1, 1, 7, 1, 1, 0, 4)._replace(**{field: value})
    with pytest.raises(ValueError, match="refusing to send") as info:
        encode_header(h)
    assert field in str(info.value)


def test_reduce_op_is_an_int_on_the_wire():
    """An IntEnum is not an int to msgpack's receiver: OpContext passes plain ints."""
    with pytest.raises(ValueError, match="reduce"):
        encode_header(GOOD._replace(reduce=ReduceOp.MAX))


def test_random_bytes_never_escape_as_other_errors():
    rng = random.Random(1234)
    good = encode_header(GOOD)
    for _ in range(5000):
        if rng.random() < 0.5:
            buf = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 80)))
        else:  # mutate a valid header
            b = bytearray(good)
            for _ in range(rng.randint(1, 4)):
                b[rng.randrange(len(b))] = rng.getrandbits(8)
            buf = bytes(b)
        try:
            h = decode_header(buf)
        except ProtocolError:
            continue
        assert encode_header(h)  # whatever decodes could have been sent


def test_random_fields_decode_exactly_when_they_encode():
    """Fuzz the field values: decode accepts a header exactly when encode would have sent it,
    and a decoded header round-trips unchanged."""
    rng = random.Random(99)
    choices = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 255, 256, 1 << 31, (1 << 62) - 1, 1 << 62, -1]
    for _ in range(20000):
        fields = [rng.choice(choices) for _ in range(11)]
        buf = msgpack.packb([VERSION, *fields])
        try:
            sent = encode_header(Header(*fields))
        except ValueError:
            sent = None
        try:
            h = decode_header(buf)
        except ProtocolError:
            assert sent is None, fields
            continue
        assert sent is not None and h == Header(*fields), fields
