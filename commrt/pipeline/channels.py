"""The pipeline runtime's transfers: one transport message per tensor list once its layout is known.

A tensor list whose shapes and dtypes the receiver does not know needs a header before its
payloads (p2p.py: a header message, then one message per tensor). That costs a second send, a
second receive and a header decode per micro-batch, which on a small model is several times the
micro-batch's compute (issue 29). But a schedule sends the same layouts every step: message i of
a channel (peer, tag) in step s has, in a training loop, the layout message i had in step s - 1.
Both ends remember that layout, so both know the next message's exact size before it is sent:

* layout known on both ends (and at most ``COMBINE_MAX`` bytes): ONE message of exactly
  ``frame_bytes(layout)``: a 64-byte prefix (flag, up to six metadata integers) and the payloads at
  64-byte aligned offsets, which the receiver posted for the whole step at its start and reads
  as views, with no header to decode and no second receive;
* the sender's layout differs from the remembered one (a batch of other rows): a message of the
  same size flagged ``FALLBACK``, then p2p's header and payloads on the channel's side tag;
* no layout remembered (the first step) or a larger one: p2p's header on the channel's tag, its
  payloads on the side tag, posted as soon as the header is in (``pump``).

Each (peer, tag) is first-in-first-out in both transports, the side tag too, and both ends open
a channel's messages in order, so the two agree on which message index they are at. A step that
fails leaves receives posted and messages in flight, which no later step could tell from its
own: the schedule refuses to run another (runtime.py).
"""
from __future__ import annotations

import struct

import torch

from commrt import distributed as dist
from commrt.runtime.errors import ProtocolError
from commrt.pipeline.p2p import HEADER_BYTES, SendHandle, _bytes, allocate, decode_header, encode_header

PREFIX = 64  # flag, metadata count, up to six int64 metadata; payloads start 64-byte aligned
META_MAX = 6
_PREFIX = struct.Struct("<II6q")
DATA, FALLBACK = 1, 2
# up to one ring piece (chunk_bytes): packing 1 MiB (~24 us) costs less than a second message (~63 us
# of the sender's, plus the receiver's header decode and late payload posting; issue 29)
COMBINE_MAX = 4 << 20
SPARE = 8  # packed buffers kept for reuse: a fresh 1 MiB buffer is 256 page faults on its first write
SIDE_TAG = 1 << 20  # tag + SIDE_TAG: the channel's payloads and fallback headers (gloo takes 31-bit tags)


def _align(n: int) -> int:
    return (n + PREFIX - 1) // PREFIX * PREFIX


def layout_of(tensors: list[torch.Tensor]) -> tuple:
    return tuple((t.dtype, tuple(t.shape)) for t in tensors)


def frame_bytes(layout: tuple) -> int:
    return PREFIX + sum(_align(torch.Size(shape).numel() * dtype.itemsize) for dtype, shape in layout)


def pack_frame(tensors: list[torch.Tensor], meta: tuple[int, ...], size: int, flag: int = DATA,
               buf: torch.Tensor | None = None) -> torch.Tensor:
    """One message of ``size`` bytes: the prefix, then (flag DATA) every tensor at its offset;
    written into ``buf`` (``size`` bytes, no longer in use) when given."""
    if len(meta) > META_MAX:
        raise ValueError(f"a pipeline message carries at most {META_MAX} metadata integers, got {len(meta)}")
    buf = torch.empty(size, dtype=torch.uint8) if buf is None else buf
    _PREFIX.pack_into(buf.numpy(), 0, flag, len(meta), *meta, *(0,) * (META_MAX - len(meta)))
    off = PREFIX
    for t in tensors if flag == DATA else ():
        n = t.numel() * t.element_size()
        if n:
            buf[off:off + n].view(t.dtype).view(t.shape).copy_(t)
        off += _align(n)
    return buf


def unpack_frame(buf: torch.Tensor, layout: tuple) -> tuple[int, tuple[int, ...], list[torch.Tensor]]:
    """(flag, meta, tensors as views of ``buf``) of a message ``pack_frame`` wrote for ``layout``."""
    flag, count, *meta = _PREFIX.unpack_from(buf.numpy(), 0)
    if flag not in (DATA, FALLBACK):
        raise ProtocolError(f"pipeline message with unknown flag {flag}")
    if count > META_MAX:
        raise ProtocolError(f"pipeline message with {count} metadata integers (at most {META_MAX})")
    out, off = [], PREFIX
    for dtype, shape in layout if flag == DATA else ():
        n = torch.Size(shape).numel() * dtype.itemsize
        out.append(buf[off:off + n].view(dtype).view(shape) if n else torch.empty(shape, dtype=dtype))
        off += _align(n)
    return flag, tuple(meta[:count]), out


class _Msg:
    """One posted message of a channel: its receive, and what the receiver expects in it."""
    __slots__ = ("index", "buf", "work", "layout", "meta", "tensors", "works")

    def __init__(self, index: int, buf, work, layout):
        self.index, self.buf, self.work, self.layout = index, buf, work, layout
        self.meta = None  # set when opened
        self.tensors, self.works = [], []


class Channels:
    """A schedule's transfers over its whole life: what each channel's message i looked like last
    step, on the sending and on the receiving side."""

    def __init__(self, group):
        self.group = group
        self._sent: dict[tuple[int, int, int], tuple] = {}  # (dst, tag, i) -> layout sent last step
        self._got: dict[tuple[int, int, int], tuple] = {}  # (src, tag, i) -> layout received
        self._out: dict[tuple[int, int], int] = {}  # (dst, tag) -> messages sent this step
        self._queue: dict[tuple[int, int], list[_Msg]] = {}
        self._opened: dict[tuple[int, int], int] = {}
        self._spare: list[tuple[object, torch.Tensor]] = []  # (send's work, its packed buffer)

    def begin(self, plan: list[tuple[int, int]]) -> None:
        """Start a step: post every receive of ``plan`` ((source, tag) in the order taken)."""
        self._out = {}
        self._queue = {chan: [] for chan in plan}
        self._opened = {chan: 0 for chan in plan}
        for src, tag in plan:
            q = self._queue[(src, tag)]
            layout = self._got.get((src, tag, len(q)))
            if layout is not None and frame_bytes(layout) > COMBINE_MAX:
                layout = None
            # known or not is said by the layout, not by the size: a frame may be HEADER_BYTES long
            buf = torch.empty(HEADER_BYTES if layout is None else frame_bytes(layout), dtype=torch.uint8)
            q.append(_Msg(len(q), buf, dist.irecv(buf, src, self.group, tag), layout))

    # -- sending ---------------------------------------------------------------------------
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int, meta: tuple[int, ...]) -> SendHandle:
        """Post the channel's next message; returns at once. It counts as sent (``sent``, which
        notices.tell reads) only once posted: one that raised first (a header it cannot encode)
        is still owed, so the neighbour waiting for it gets the step's failure notice there,
        where it waited out its whole deadline (review_pp item 2)."""
        i = self._out.get((dst, tag), 0)
        sent = [t.detach().contiguous() for t in tensors]
        layout = layout_of(sent)
        handle = self._post(sent, dst, tag, meta, layout, self._sent.get((dst, tag, i)))
        self._out[(dst, tag)] = i + 1
        self._sent[(dst, tag, i)] = layout
        return handle

    def _post(self, sent, dst: int, tag: int, meta, layout: tuple, before: tuple | None) -> SendHandle:
        """The message in the form both ends expect after ``before`` (module docstring)."""
        if before is None or frame_bytes(before) > COMBINE_MAX:
            return self._split(sent, dst, tag, tag + SIDE_TAG, self._header(sent, meta))
        same = before == layout
        header = None if same else self._header(sent, meta)  # may raise: before the frame goes
        size = frame_bytes(before)
        buf = pack_frame(sent, meta, size, DATA if same else FALLBACK, self._reuse(size))
        work = dist.isend(buf, dst, self.group, tag)
        self._spare = [*self._spare[-SPARE + 1:], (work, buf)]
        if same:
            return SendHandle([work], [buf])
        rest = self._split(sent, dst, tag + SIDE_TAG, tag + SIDE_TAG, header)
        return SendHandle([work, *rest.works], [buf, *rest._keep])

    def sent(self, dst: int, tag: int) -> int:
        """Messages posted on (dst, tag) this step."""
        return self._out.get((dst, tag), 0)

    def _reuse(self, size: int) -> torch.Tensor | None:
        """A packed buffer of ``size`` bytes whose send is complete (its bytes are in the ring or
        on the wire), or None."""
        for i, (work, buf) in enumerate(self._spare):
            if buf.numel() == size and (work is None or work.is_completed()):
                del self._spare[i]
                return buf
        return None

    @staticmethod
    def _header(sent, meta) -> torch.Tensor:
        return torch.frombuffer(bytearray(encode_header(sent, meta)), dtype=torch.uint8)

    def _split(self, sent, dst: int, head_tag: int, side_tag: int, header: torch.Tensor) -> SendHandle:
        """p2p's ``header`` on ``head_tag``, every payload on ``side_tag``."""
        works = [dist.isend(header, dst, self.group, head_tag)]
        works += [dist.isend(_bytes(t), dst, self.group, side_tag) for t in sent if t.numel()]
        return SendHandle(works, [header, *sent])

    # -- receiving -------------------------------------------------------------------------
    def pump(self) -> None:
        """Post the payload receives of split messages whose header is in; never blocks."""
        for chan, q in self._queue.items():
            k = self._opened[chan]
            if k < len(q) and q[k].layout is None and q[k].work.is_completed():
                self._open(chan, q[k])

    def _open(self, chan: tuple[int, int], msg: _Msg) -> None:
        src, tag = chan
        self._opened[chan] += 1
        msg.work.wait()
        header = msg.buf
        if msg.layout is not None:
            flag, msg.meta, msg.tensors = unpack_frame(msg.buf, msg.layout)
            if flag == DATA:
                return
            header = torch.empty(HEADER_BYTES, dtype=torch.uint8)  # FALLBACK: all on the side tag
            dist.irecv(header, src, self.group, tag + SIDE_TAG).wait()
        msg.meta, specs = decode_header(header.numpy().tobytes())
        msg.tensors = allocate(specs, src)
        msg.works = [dist.irecv(_bytes(t), src, self.group, tag + SIDE_TAG) for t in msg.tensors if t.numel()]
        self._got[(src, tag, msg.index)] = layout_of(msg.tensors)

    def take(self, src: int, tag: int) -> tuple[tuple[int, ...], list[torch.Tensor]]:
        """The next message on (src, tag): (meta, tensors)."""
        chan = (src, tag)
        q = self._queue.get(chan)
        if not q:
            raise ProtocolError(f"receive from rank {src} tag {tag} that the step's plan does not hold")
        msg = q[0]
        if msg.meta is None:
            self._open(chan, msg)
        for w in msg.works:
            w.wait()
        q.pop(0)
        self._opened[chan] -= 1
        return msg.meta, msg.tensors
