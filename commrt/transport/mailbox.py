"""Small point-to-point messages between ranks of one node without ZeroMQ's I/O threads.

A 4 KiB message over ZeroMQ costs ~75 us one way on a 2-core machine, most of it three thread
wake-ups (the sender's I/O thread, the receiver's I/O thread, the receiving thread) sharing two
cores (progress.py). When the receiver is already waiting for a message, that is all avoidable:
the sender writes the whole message (wire header and payload) into a mailbox in the shared
memory of the pair's ring (shm_p2p.py: the same sealed, nameless segment, behind the data ring),
and the waiting receiver, which spins on the mailbox for up to 2 ms (p2p.SPIN_S) before it
blocks on its socket, reads it from there. A payload of 32 KiB or more still goes into the data
ring; its descriptor then takes the mailbox instead of the socket. MPI's shared-memory "eager"
protocol, in small.

When it is used (``Outbox.try_put``), so that nothing is reordered and nothing is stranded:

1. The receiver is spinning: it set ``W_SPIN`` in the pair's control page, and it clears it
   before it blocks on its socket, then looks at the mailbox once more.
2. Everything the sender sent to this receiver over the socket has been read (``W_SOCK_READ``,
   which the receiver counts up as it reads them, equals the sender's count). The receiver, for
   its part, empties the mailbox before it handles any socket message from that sender. So one
   sender's messages are handled in the order they were sent, whichever path each took.
3. After publishing, the sender looks at ``W_SPIN`` again: if the receiver stopped spinning in
   the meantime, it may have looked at the mailbox for the last time before the record landed,
   so the sender rings a doorbell over the socket (an empty P2P message with root
   ``P2P_DOORBELL``), which makes the receiver empty the mailbox. Both sides put a full memory
   barrier (a lock's atomic instruction) between their store and their load: the classic
   store-load handshake, so at least one of them sees the other's store.

A record: u32 length (whole record, 8-aligned), u32 header length, the encoded wire header, the
payload. A record that would run past the mailbox's end is preceded by a wrap marker. Everything
the receiver reads from the mailbox is validated like a socket message: a bad record is a
ProtocolError against that peer, never an index or a size used as is.
"""
from __future__ import annotations

import struct
import threading

from commrt.runtime.errors import ProtocolError
from commrt.transport.messages import Message
from commrt.transport.wire import MAX_HEADER_BYTES, P2P, P2P_SHM_ROOT, decode_header, encode_header

MAILBOX_BYTES = 256 << 10  # per ordered pair, after the data ring in the ring's segment
MAX_PAYLOAD = 32 << 10  # larger payloads take the data ring (a descriptor) or the socket
W_MHEAD, W_MTAIL, W_SPIN, W_SOCK_READ = 2, 3, 4, 5  # control words (shm_p2p: 1 tail, 64 mapped)
_REC = struct.Struct("<II")
WRAP = 0xFFFFFFFF
_BARRIER = threading.Lock()


def barrier() -> None:
    """A full memory barrier: acquiring a lock is an atomic read-modify-write (x86-64: lock cmpxchg)."""
    _BARRIER.acquire()
    _BARRIER.release()


class Payload:
    """A mailbox record's payload, copied out: what Matching lands (``.buffer``) like a zmq frame."""

    __slots__ = ("buffer",)

    def __init__(self, data: bytes):
        self.buffer = data

    def __len__(self) -> int:
        return len(self.buffer)


class Outbox:
    """The sender's end of one pair's mailbox (its owner: whoever holds the engine's send lock)."""

    def __init__(self, ctl: memoryview, box: memoryview):
        self._ctl, self._box = ctl, box
        self.head = 0
        self.sock_sent = 0  # P2P messages sent to this receiver over the socket

    def open(self) -> bool:
        """The receiver spins, and has read every socket message we sent it (rules 1-2)."""
        return bool(self._ctl[W_SPIN]) and self._ctl[W_SOCK_READ] == self.sock_sent

    def try_put(self, header, payload) -> bool | None:
        """Write one message: None when it must take the socket (rules 1-2 of the module's
        docstring, or no room), True when it is in the mailbox, False when it is in the mailbox
        but the receiver stopped spinning meanwhile: the caller rings the doorbell."""
        if not self.open():
            return None
        raw = encode_header(header)
        n = len(payload)
        size = (_REC.size + len(raw) + n + 7) & ~7
        at = self.head % MAILBOX_BYTES
        pos = self.head + (MAILBOX_BYTES - at if at + size > MAILBOX_BYTES else 0)
        if pos + size - self._ctl[W_MTAIL] > MAILBOX_BYTES:
            return None
        if pos != self.head:
            _REC.pack_into(self._box, at, WRAP, 0)
        at = pos % MAILBOX_BYTES
        _REC.pack_into(self._box, at, size, len(raw))
        a = at + _REC.size
        self._box[a:a + len(raw)] = raw
        if n:
            self._box[a + len(raw):a + len(raw) + n] = memoryview(payload).cast("B")
        self.head = pos + size
        self._ctl[W_MHEAD] = self.head  # after the record: x86-64 keeps stores in order
        barrier()
        return bool(self._ctl[W_SPIN])


    def close(self) -> None:
        self._box.release()


class Inbox:
    """The receiver's end of one pair's mailbox (its owner: the holder of the engine's reader)."""

    def __init__(self, src: int, ctl: memoryview, box: memoryview):
        self.src, self._ctl, self._box = src, ctl, box
        self.sock_read = 0

    def pending(self) -> bool:
        return self._ctl[W_MHEAD] != self._ctl[W_MTAIL]

    def spin(self, on: bool) -> None:
        self._ctl[W_SPIN] = int(on)

    def socket_read(self) -> None:
        """A P2P socket message from this sender was handled (rule 2)."""
        self.sock_read += 1
        self._ctl[W_SOCK_READ] = self.sock_read

    def take(self) -> list[Message]:
        """Every record published so far, in order, as messages (payloads copied out)."""
        head, tail = self._ctl[W_MHEAD], self._ctl[W_MTAIL]
        if head == tail:
            return []
        if not 0 < head - tail <= MAILBOX_BYTES:
            raise ProtocolError(f"rank index {self.src}'s mailbox head {head} is not within reach of {tail}")
        out = []
        while tail != head:
            at = tail % MAILBOX_BYTES
            size, hlen = _REC.unpack_from(self._box, at)
            if size == WRAP:
                tail += MAILBOX_BYTES - at
                if tail > head:
                    raise ProtocolError(f"rank index {self.src} wrapped its mailbox past its head")
                continue
            if size % 8 or not _REC.size < size <= MAILBOX_BYTES - at or tail + size > head \
                    or not 0 < hlen <= min(MAX_HEADER_BYTES, size - _REC.size):
                raise ProtocolError(f"rank index {self.src} wrote a malformed mailbox record ({size}, {hlen})")
            a = at + _REC.size
            h = decode_header(self._box[a:a + hlen])
            if h.kind != P2P or h.src != self.src or h.root not in (0, P2P_SHM_ROOT) or h.nbytes > size - _REC.size - hlen:
                raise ProtocolError(f"rank index {self.src} wrote a mailbox record that is not its P2P message: {h}")
            out.append(Message(h, Payload(bytes(self._box[a + hlen:a + hlen + h.nbytes]))))
            tail += size
        self._ctl[W_MTAIL] = tail  # after the copies
        return out
