import random

import msgpack
import pytest

from commrt.errors import ProtocolError
from commrt.wire import COLL, P2P, VERSION, Header, decode_header, encode_header


def test_round_trip():
    h = Header(COLL, 3, 1 << 40, 2, 1, 4, 123456789, 7, 1 << 20)
    assert decode_header(encode_header(h)) == h
    h2 = Header(P2P, 0, 0, 0, 0, 1, 0, 0, 0)
    assert decode_header(encode_header(h2)) == h2
    assert len(encode_header(h)) < 64


@pytest.mark.parametrize("bad", [
    b"", b"\x00", b"\xff" * 10, msgpack.packb([VERSION + 1] + [0] * 9),
    msgpack.packb([VERSION, 0, 0, 0, 0, 0, 0, 0, 0]),            # too short
    msgpack.packb([VERSION, 0, 0, 0, -1, 0, 0, 0, 0, 0]),        # negative
    msgpack.packb([VERSION, 9, 0, 0, 0, 0, 0, 0, 0, 0]),         # unknown kind
    msgpack.packb([VERSION, 0, 0, 0, "x", 0, 0, 0, 0, 0]),       # a string
    msgpack.packb({"v": 1}), msgpack.packb([VERSION] + [0] * 9 + [0]),
    msgpack.packb([VERSION, 0, 0, 0, 0, 0, 0, 0, 0, 1.5]),
    msgpack.packb([VERSION, 0, 0, 0, 0, 0, 0, 0, 0, msgpack.ExtType(1, b"x")]),
    msgpack.packb([VERSION, 0, 0, 0, 0, 0, 0, 0, 0, True]),
    b"\x9a" + b"\xcf" + b"\xff" * 8,                               # truncated
    b"\x91" * 300,                                                 # oversized/nested
])
def test_malformed_headers_are_protocol_errors(bad):
    with pytest.raises(ProtocolError):
        decode_header(bad)


def test_random_bytes_never_escape_as_other_errors():
    rng = random.Random(1234)
    good = encode_header(Header(COLL, 1, 2, 3, 4, 5, 6, 7, 8))
    for _ in range(5000):
        if rng.random() < 0.5:
            buf = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 80)))
        else:  # mutate a valid header
            b = bytearray(good)
            for _ in range(rng.randint(1, 4)):
                b[rng.randrange(len(b))] = rng.getrandbits(8)
            buf = bytes(b)
        try:
            decode_header(buf)
        except ProtocolError:
            pass
