"""The zmq backend's shared-memory setup: this rank's segment and handoff socket, made before
the address exchange (which publishes the socket's name), and the group's Channel once the
exchange shows that every member is on this node: each rank then hands every peer its segment
and its point-to-point ring to that peer as descriptors over the authenticated socket
(transport/handoff.py) and maps what they hand it (transport/shm.py runs the steps)."""
from __future__ import annotations

import logging
import time

from commrt.runtime.errors import ConfigError, ProtocolError
from commrt.transport import shm, shm_p2p
from commrt.transport.endpoint import Endpoint
from commrt.transport.handoff import Handoff

log = logging.getLogger(__name__)


class LocalSegment:
    """This rank's segment (descriptor and mapping) and the socket that hands it over; ``name``
    (the socket's) is what the address exchange publishes."""

    def __init__(self, slot_bytes: int):
        self.slot_bytes = slot_bytes
        self.fd, self.mm = shm.create(slot_bytes)
        try:
            self.handoff = Handoff()
        except BaseException:
            self.close()
            raise
        self.name = self.handoff.name

    def close(self, unmap: bool = True) -> None:
        """Stop handing the segment over; ``unmap`` False keeps the mapping (a Channel's now)."""
        if getattr(self, "handoff", None) is not None:
            self.handoff.close()
            self.handoff = None
        shm.close_fd(self.fd)
        self.fd = None
        if unmap:
            self.mm.close()


def make_segment(mode: str, slot_bytes: int = shm.SLOT_BYTES) -> LocalSegment | None:
    """This rank's shared-memory segment for ``[comm] intra_node`` (None: TCP only), of two
    slots of ``[comm] shm_slot_bytes``."""
    if mode == "tcp":
        return None
    why = shm.supported()
    if why is None:
        try:
            return LocalSegment(slot_bytes)
        except OSError as exc:
            why = f"cannot create a shared-memory segment: {exc}"
    if mode == "shm":
        raise ConfigError(f"[comm] intra_node = 'shm' cannot be used here: {why}")
    log.info("intra-node traffic stays on TCP: %s", why)
    return None


def shares_memory(entries: list[str]) -> bool:
    """Whether the members of ``entries`` (rank r's "shm:<node>:<socket name>") will share
    memory: more than one, all on one node, each with a segment."""
    return (len(entries) > 1 and len({e.rsplit(":", 1)[0] for e in entries}) == 1
            and all(e.rsplit(":", 1)[-1] != "-" for e in entries))


def open_channel(ep: Endpoint, seg: LocalSegment | None, entries: list[str],
                 heartbeat_s: float) -> shm.Channel | None:
    """The Channel over every member's segment when each published one on this rank's node
    (every rank sees the same table, so all decide alike); otherwise None, and our segment
    ``seg`` goes at once. ``entries[r]``: rank r's "shm:<node>:<socket name>"."""
    rank, size = ep.rank, len(entries)
    names = [e.rsplit(":", 1)[-1] for e in entries]
    if seg is None or not shares_memory(entries):
        if seg is not None:
            seg.close()
        return None
    peers = [p for p in range(size) if p != rank]
    for p in peers:  # their connections' monitors tell us a peer died
        ep.socket_to(p)
    outs, got, maps, channel = {}, {}, [], None
    try:
        outs = {p: shm_p2p.make_ring() for p in peers}
        got = seg.handoff.exchange(ep.transport.guard.secret, rank, {p: [seg.fd, outs[p][0]] for p in peers},
                                   {p: names[p] for p in peers}, time.monotonic() + ep.timeout_s,
                                   lambda waiting: shm.watch_peers(ep, waiting, "connect", 0))
        for p in range(size):
            maps.append(seg.mm if p == rank else _attach(got[p], 0, seg.slot_bytes, p))
        ins = {p: _attach(got[p], 1, shm_p2p.RING_SLOT, p) for p in peers}
        channel = shm.Channel(ep, maps, names, seg.slot_bytes, heartbeat_s)
        channel.rings = {p: (shm_p2p.OutRing(*outs[p]), shm_p2p.InRing(ins[p])) for p in peers}
        channel.attach_all()
    except BaseException:
        _undo(seg, outs, maps, channel)
        raise
    finally:
        for fds in got.values():
            for fd in fds:
                shm.close_fd(fd)
    seg.close(unmap=False)
    return channel


def _attach(fds: list[int], i: int, slot_bytes: int, peer: int):
    if len(fds) != 2:
        raise ProtocolError(f"rank {peer} handed over {len(fds)} descriptors, not its segment and ring")
    return shm.attach(fds[i], slot_bytes)


def _undo(seg: LocalSegment, outs: dict, maps: list, channel: shm.Channel | None) -> None:
    """A failed setup: close what we made and mapped (memory goes with the last mapping)."""
    if channel is not None:
        channel.close()
    else:
        for m in maps:
            if m is not seg.mm:
                m.close()
    seg.close(unmap=channel is None)
    for fd, mm in outs.values():
        shm.close_fd(fd)
        try:
            mm.close()
        except BufferError:
            pass
