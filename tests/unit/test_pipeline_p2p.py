"""The tensor-list header of pipeline transfers: round trip, limits and hostile bytes (no processes)."""
import random

import pytest
import torch

from commrt.runtime.errors import ProtocolError
from commrt.pipeline.p2p import HEADER_BYTES, P2POp, decode_header, encode_header


def test_header_round_trips_shapes_dtypes_and_metadata():
    ts = [torch.zeros(2, 3), torch.zeros(0, dtype=torch.int64), torch.zeros((), dtype=torch.bfloat16),
          torch.zeros(1, 2, 3, 4, dtype=torch.uint8)]
    data = encode_header(ts, (7, 0, 3))
    assert len(data) == HEADER_BYTES
    meta, specs = decode_header(data)
    assert meta == (7, 0, 3)
    assert specs == [(t.dtype, tuple(t.shape)) for t in ts]
    assert decode_header(encode_header([])) == ((), [])


def test_a_list_too_large_or_an_unknown_dtype_is_refused_before_sending():
    with pytest.raises(ValueError, match="too large"):
        encode_header([torch.zeros(1)] * 65)
    with pytest.raises(TypeError, match="not supported"):
        encode_header([torch.zeros(1, dtype=torch.complex64)])


def test_hostile_headers_are_protocol_errors():
    good = bytearray(encode_header([torch.zeros(2, 3)], (1,)))
    with pytest.raises(ProtocolError):
        decode_header(bytes(good[:-1]))
    bad_len = bytearray(good)
    bad_len[0:4] = (5000).to_bytes(4, "little")
    with pytest.raises(ProtocolError):
        decode_header(bytes(bad_len))
    rng = random.Random(0)
    for _ in range(2000):  # random corruption either decodes to a valid header or is a ProtocolError
        data = bytearray(good)
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(4, 40)] = rng.randrange(256)
        try:
            meta, specs = decode_header(bytes(data))
        except ProtocolError:
            continue
        assert all(isinstance(v, int) and v >= 0 for v in meta)
        assert all(isinstance(d, torch.dtype) and all(x >= 0 for x in s) for d, s in specs)


def _claiming(specs) -> bytes:
    """A header as encode_header lays it out, with specs no real tensor list would have."""
    import struct
    import msgpack
    body = msgpack.packb([1, [], specs])
    return struct.pack("<I", len(body)) + body + bytes(HEADER_BYTES - 4 - len(body))


def test_a_header_claiming_more_payload_than_a_message_may_carry_is_refused_before_allocating():
    from commrt.runtime import dtypes
    from commrt.pipeline.p2p import MAX_DIM, allocate
    f64, f32 = dtypes.code_of(torch.float64), dtypes.code_of(torch.float32)
    with pytest.raises(ProtocolError, match="claims 8796093022208 bytes"):
        decode_header(_claiming([[f64, MAX_DIM]]))  # 2^40 doubles: each dimension within bounds, 8 TiB
    with pytest.raises(ProtocolError, match="claims"):
        decode_header(_claiming([[f32, 1 << 38]] * 5))  # five 1 TiB tensors
    _, specs = decode_header(_claiming([[f32, 1 << 36], [f32, 3]]))  # 256 GiB: passes the header...
    with pytest.raises(ProtocolError, match="from rank 3 asks for 1099511627824 bytes"):
        allocate(specs * 4, 3)  # ...but not this process's memory (1 TiB, nothing committed): a typed error


def test_p2pop_takes_only_isend_or_irecv():
    with pytest.raises(ValueError, match="isend or commrt.irecv"):
        P2POp(print, torch.zeros(1), 1)


def test_a_frame_carries_tensors_of_its_layout_at_aligned_offsets_and_a_fallback_none():
    from commrt.pipeline.channels import DATA, FALLBACK, PREFIX, frame_bytes, layout_of, pack_frame, unpack_frame
    ts = [torch.randn(3, 5), torch.arange(7, dtype=torch.int64), torch.zeros(0, 2), torch.tensor(2.5).to(torch.bfloat16)]
    layout = layout_of(ts)
    size = frame_bytes(layout)
    assert size == PREFIX + 64 + 64 + 0 + 64  # each payload 64-byte aligned, so every dtype views in place
    flag, meta, got = unpack_frame(pack_frame(ts, (3, 1 << 39), size), layout)
    assert (flag, meta) == (DATA, (3, 1 << 39))
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, ts)) and len(got) == len(ts)
    flag, meta, got = unpack_frame(pack_frame(ts, (0, 9), size, FALLBACK), layout)
    assert (flag, meta, got) == (FALLBACK, (0, 9), [])
    bad = pack_frame(ts, (0, 0), size)
    bad[0] = 7
    with pytest.raises(ProtocolError, match="unknown flag 7"):
        unpack_frame(bad, layout)


class _Work:
    def __init__(self):
        self.done = False

    def is_completed(self):
        return self.done


def test_a_packed_buffer_is_reused_only_once_its_send_is_complete(monkeypatch):
    """Channels reuses a packed message's buffer for the next one (no fresh pages per message),
    but never while the transport may still read it: a pending send's bytes stay as sent."""
    from commrt.pipeline import channels
    sent = []

    def isend(buf, dst, group, tag):
        sent.append((buf, buf.clone(), _Work()))  # (the buffer, its bytes when sent, its work)
        return sent[-1][2]
    monkeypatch.setattr(channels.dist, "isend", isend)
    ch = channels.Channels(None)
    layout = channels.layout_of([torch.zeros(4, 8)])
    ch._sent = {(1, 0, i): layout for i in range(4)}  # the layouts a step before left behind
    ch.send([torch.full((4, 8), 1.0)], 1, 0, (0, 0))
    ch.send([torch.full((4, 8), 2.0)], 1, 0, (0, 1))  # the first is still in flight
    assert sent[1][0].data_ptr() != sent[0][0].data_ptr()
    assert torch.equal(sent[0][0], sent[0][1])  # its bytes untouched
    sent[0][2].done = True
    ch.send([torch.full((4, 8), 3.0)], 1, 0, (0, 2))
    assert sent[2][0].data_ptr() == sent[0][0].data_ptr()  # complete: its buffer is the next one's
    flag, meta, got = channels.unpack_frame(sent[2][0], layout)
    assert (flag, meta) == (channels.DATA, (0, 2)) and torch.equal(got[0], torch.full((4, 8), 3.0))


class _Wire:
    """A one-process stand-in for isend/irecv: each (peer, tag) first in first out; a receive
    takes the next message of its tag when posted (tests send a whole step before receiving it)
    and, like both transports, refuses a message of another size than its buffer."""

    def __init__(self):
        self.queues = {}

    def isend(self, buf, dst, group, tag):
        self.queues.setdefault(tag, []).append(buf.clone())
        return _Done()

    def irecv(self, buf, src, group, tag):
        msg = self.queues[tag].pop(0)
        assert msg.numel() == buf.numel(), f"a {msg.numel()}-byte message into a {buf.numel()}-byte receive"
        buf.copy_(msg)
        return _Done()


class _Done:
    def is_completed(self):
        return True

    def wait(self):
        pass


@pytest.mark.parametrize("shape", [(4, 60), (4, 61), (2, 2)])
def test_a_layout_whose_frame_is_exactly_a_headers_size_is_opened_as_a_frame(monkeypatch, shape):
    """From its second step a channel sends a known layout as one frame of frame_bytes(layout);
    the receiver told that frame from a header by its size, so a layout of exactly
    HEADER_BYTES (64-byte prefix + one 240-float tensor, e.g. 4 rows of 60 features) was
    decoded as a header: a ProtocolError on the second step of a model that trains fine."""
    from commrt.pipeline import channels
    wire = _Wire()
    monkeypatch.setattr(channels.dist, "isend", wire.isend)
    monkeypatch.setattr(channels.dist, "irecv", wire.irecv)
    sender, receiver = channels.Channels(None), channels.Channels(None)
    for step in range(3):
        x = torch.randn(shape)
        sender.begin([])
        sender.send([x], 1, 0, (0, step)).wait()
        receiver.begin([(0, 0)])
        meta, got = receiver.take(0, 0)
        assert meta == (0, step) and len(got) == 1 and torch.equal(got[0], x)
