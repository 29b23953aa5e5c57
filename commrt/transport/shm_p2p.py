"""Point-to-point payloads between ranks of one node through shared memory.

The point-to-point engine (p2p.py) keeps doing everything else: its sockets carry every
message's header, in order, and with it the matching by (source, tag), the early-message
bound, the deadlines and the peers' liveness. What changes is where a large payload travels.
The sender copies it into a ring it owns, one per destination, and the socket frame carries
only where it lies (``Descriptor``); the receiver copies it out into the posted tensor and
hands the space back. One copy each side, no kernel copies, no I/O thread, and an isend is
complete as soon as its pieces are in the ring: it never waits for the receiver.

A ring is a segment like the collectives' (segments.py: an anonymous memory file, sealed at its
size), one per ordered pair of a shared-memory group, made when the group connects and handed
to its receiver with the collectives' segment over the authenticated handoff socket
(handoff.py): nothing has a name anyone could open, and the memory goes with the last process
that maps it, whether or not a message was ever received. Its pages are reserved on first use.
The descriptor's name only tells the receiver which ring a payload lies in (it must not change).
The receiver publishes how far it has consumed in the
ring's control word; the sender writes only behind that. Data is written before the socket
send that announces it, so a receiver that has the header sees the bytes (the send is a
system call; the receiver reads after its own). When a ring has had no room for FULL_WAIT_S
(the receiver is not taking what it was sent) the piece goes inline over the socket, so a send
never waits on a receive that is posted only after it.
"""
from __future__ import annotations

import collections
import mmap
import secrets
import struct

from commrt.runtime.errors import ProtocolError
from commrt.transport.wire import P2P_SHM_ROOT as SHM_ROOT
from commrt.transport import shm
from commrt.transport.mailbox import MAILBOX_BYTES, MAX_PAYLOAD, Inbox, Outbox

RING_BYTES = 8 << 20  # per (sender, receiver) pair: two 4 MiB pieces (the default chunk_bytes) in flight
MIN_BYTES = 32 << 10  # smaller payloads stay inline on the socket: one message beats two copies
W_TAIL = shm.W_COUNTER  # the receiver's consumed position (bytes, counting up forever)
W_MAPPED = shm.ATTACH_BASE  # set by the receiver once it has mapped the ring
FULL = (-1, -1, "")  # Rings.place: eligible, but the ring has no room yet
FULL_WAIT_S = 0.05  # a piece waits this long for room (the receiver is copying out), then goes inline
RING_SLOT = (RING_BYTES + MAILBOX_BYTES) // 2  # shm's layout: CTL + 2 x slot = CTL + ring + mailbox
_DESC = struct.Struct("<qq")  # position, length; then the ring's name, padded to 8 bytes


def descriptor(pos: int, length: int, name: str) -> bytes:
    raw = _DESC.pack(pos, length) + name.encode()
    return raw + b"\0" * (-len(raw) % 8)  # a multiple of every item size (wire.problem)


def parse(frame: bytes | memoryview) -> tuple[int, int, str]:
    buf = bytes(frame)
    if len(buf) < _DESC.size + 8 or len(buf) % 8:
        raise ProtocolError(f"a shared-memory descriptor of {len(buf)} bytes")
    pos, length = _DESC.unpack_from(buf)
    try:
        name = buf[_DESC.size:].rstrip(b"\0").decode()
    except UnicodeDecodeError:
        raise ProtocolError("a shared-memory descriptor with an undecodable name") from None
    return pos, length, name


def make_ring() -> tuple[int, mmap.mmap]:
    """A ring's segment, its pages unreserved: (descriptor to hand over, mapping)."""
    return shm.create(RING_SLOT, reserve_now=False)


class OutRing:
    """The sender's ring to one destination (one owner: the engine thread), from ``make_ring``."""

    def __init__(self, fd: int, mm: mmap.mmap) -> None:
        self.name = f"ring-{secrets.token_hex(8)}"
        self._fd, self._mm = fd, mm
        self._ctl = memoryview(self._mm)[:shm.CTL_BYTES].cast("q")
        self._data = memoryview(self._mm)[shm.CTL_BYTES:]
        self.outbox = Outbox(self._ctl, self._data[RING_BYTES:])
        self.head = 0
        self.reserved = False  # its pages allocated (reserve_memory); read on every send to its peer

    def reserve_memory(self) -> None:
        """Allocate the ring's pages before the first write (OSError when memory is short)."""
        shm.reserve(self._fd)
        shm.close_fd(self._fd)
        self._fd = None
        self.reserved = True

    def reserve(self, length: int) -> int | None:
        """Where ``length`` bytes (at most RING_BYTES) would go (contiguous: skip the ring's end
        if needed), or None while there is no room."""
        at = self.head % RING_BYTES
        pos = self.head + (RING_BYTES - at if at + length > RING_BYTES else 0)
        return pos if pos + length - self._ctl[W_TAIL] <= RING_BYTES else None

    def write(self, pos: int, payload) -> None:
        at, n = pos % RING_BYTES, len(payload)
        self._data[at:at + n] = memoryview(payload).cast("B")
        self.head = pos + n

    def close(self) -> None:
        """Unmap: nothing to remove, and nothing to wait for (the receiver mapped the ring when
        the group connected; the memory goes with the last of us)."""
        shm.close_fd(self._fd)
        self._fd = None
        self.outbox.close()
        _unmap(self._ctl, self._data, self._mm)


class InRing:
    """The receiver's view of one sender's ring to it, and what of it is still in use."""

    def __init__(self, mm: mmap.mmap) -> None:
        self.name: str | None = None  # the sender's, from its first descriptor
        self._mm = mm
        self._ctl = memoryview(self._mm)[:shm.CTL_BYTES].cast("q")
        self._ctl[W_MAPPED] = 1
        self._data = memoryview(self._mm)[shm.CTL_BYTES:]
        self._box = self._data[RING_BYTES:]
        self._held: collections.deque = collections.deque()  # [pos, end, freed] in arrival order
        self._expect = 0  # no region may start before the end of the last one

    def region(self, pos: int, length: int) -> "Region":
        at = pos % RING_BYTES
        if pos < self._expect or length < 0 or at + length > RING_BYTES or pos + length - self._ctl[W_TAIL] > RING_BYTES:
            raise ProtocolError(f"a shared-memory descriptor ({pos}, {length}) outside ring {self.name}")
        self._expect = pos + length
        entry = [pos, pos + length, False]
        self._held.append(entry)
        return Region(self, entry, self._data[at:at + length])

    def free(self, entry: list) -> None:
        entry[2] = True
        tail = None
        while self._held and self._held[0][2]:
            tail = self._held.popleft()[1]
        if tail is not None:
            self._ctl[W_TAIL] = tail  # after our reads of it (x86-64 keeps loads before later stores)

    def close(self) -> None:
        self._held.clear()
        self._box.release()
        _unmap(self._ctl, self._data, self._mm)


class Region:
    """A payload lying in a ring: ``buffer`` as a zmq frame's, then ``release`` once copied out."""

    def __init__(self, ring: InRing, entry: list, view: memoryview):
        self._ring, self._entry, self.buffer = ring, entry, view

    def __len__(self) -> int:
        return len(self.buffer)

    def release(self) -> None:
        if self._entry is not None:
            self.buffer.release()
            self._ring.free(self._entry)
            self._entry = None


class Rings:
    """One engine's rings with the other members of its shared-memory group: ``pairs[p]`` is
    (our OutRing to p, p's InRing to us), as the group's setup handed them over."""

    def __init__(self, pairs: dict[int, tuple[OutRing, InRing]]):
        self.peers = set(pairs)
        self._out: dict[int, OutRing] = {p: o for p, (o, _) in pairs.items()}
        self._in: dict[int, InRing] = {p: i for p, (_, i) in pairs.items()}
        self._used: set[int] = set()  # destinations we placed a payload for (tests, stats)
        self.inboxes = {p: Inbox(p, i._ctl, i._box) for p, i in self._in.items()}
        self.mailed = 0  # messages that went through a mailbox (tests, stats)

    def place(self, dst: int, payload) -> tuple[int, int, str] | None:
        """Reserve a place for ``payload`` to ``dst``: (pos, length, ring name), FULL (no room
        yet), or None (inline: not a ring peer, small, larger than the ring could ever hold,
        or no segment could be made). A piece that can never fit must not wait for room as
        FULL does: it goes inline at once (issue 30.4)."""
        n = payload.nbytes if hasattr(payload, "nbytes") else len(payload)  # an array, a tensor, bytes
        if dst not in self.peers or not MIN_BYTES <= n <= RING_BYTES:
            return None
        if not self._ready(dst):
            return None
        ring = self._out[dst]
        self._used.add(dst)
        pos = ring.reserve(n)
        return FULL if pos is None else (pos, n, ring.name)

    def put(self, dst: int, header, payload) -> bool | None:
        """A small message into ``dst``'s mailbox (mailbox.Outbox.try_put: None = take the socket)."""
        if dst not in self.peers or len(payload) > MAX_PAYLOAD:
            return None
        ring = self._out[dst]
        if not ring.reserved and not self._ready(dst):
            return None
        put = ring.outbox.try_put(header, payload)
        self.mailed += put is not None
        return put

    def mail_open(self, dst: int) -> bool:
        """Whether ``dst``'s mailbox may take a message now (mailbox.py rules 1-2; room aside)."""
        return dst in self.peers and self._out[dst].outbox.open()

    def sent_on_socket(self, dst: int) -> None:
        """A P2P message to ``dst`` went over the socket (mailbox rule 2 counts them)."""
        if dst in self._out:
            self._out[dst].outbox.sock_sent += 1

    def _ready(self, dst: int) -> bool:
        ring = self._out[dst]
        if not ring.reserved:
            try:
                ring.reserve_memory()
            except OSError:
                self.peers = self.peers - {dst}  # memory short: this pair stays on the socket
                return False
        return True

    def write(self, dst: int, pos: int, payload) -> None:
        self._out[dst].write(pos, payload)

    def region(self, src: int, frame) -> Region:
        # its ring to us, not self.peers: our ring to it may have been dropped (_ready)
        if src not in self._in:
            raise ProtocolError(f"rank index {src} sent a shared-memory descriptor but is not on this node's group")
        pos, length, name = parse(frame.buffer)
        ring = self._in[src]
        if ring.name is None:
            ring.name = name
        elif ring.name != name:
            raise ProtocolError(f"rank index {src} switched shared-memory rings ({ring.name} -> {name})")
        return ring.region(pos, length)

    def used(self) -> bool:
        """Whether a payload went through a ring, either way."""
        return bool(self._used) or any(r.name is not None for r in self._in.values())

    def close(self) -> None:
        for ring in [*self._out.values(), *self._in.values()]:
            ring.close()
        self._out.clear()
        self._in.clear()


def _unmap(ctl: memoryview, data: memoryview, mm: mmap.mmap) -> None:
    ctl.release()
    data.release()
    try:
        mm.close()
    except BufferError:  # a tensor view still exported: the mapping goes with the process
        pass
