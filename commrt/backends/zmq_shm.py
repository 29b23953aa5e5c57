"""The zmq backend's shared-memory setup: this rank's segment, made before the address
exchange, and the group's Channel over every member's segment once the exchange shows that all
of them are on this node (transport/shm.py runs the steps)."""
from __future__ import annotations

import logging

from commrt.runtime.errors import ConfigError
from commrt.transport import shm
from commrt.transport.endpoint import Endpoint

log = logging.getLogger(__name__)


def make_segment(mode: str):
    """This rank's shared-memory segment for ``[comm] intra_node`` (None: TCP only)."""
    if mode == "tcp":
        return None
    why = shm.supported()
    if why is None:
        try:
            return shm.create(shm.SLOT_BYTES)
        except OSError as exc:
            why = f"cannot create a segment in {shm.SHM_DIR}: {exc}"
    if mode == "shm":
        raise ConfigError(f"[comm] intra_node = 'shm' cannot be used here: {why}")
    log.info("intra-node traffic stays on TCP: %s", why)
    return None


def open_channel(ep: Endpoint, seg, entries: list[str], heartbeat_s: float) -> shm.Channel | None:
    """The Channel over every member's segment when each published one on this rank's node
    (every rank sees the same table, so all decide alike); otherwise None, and our segment
    ``seg`` (name, mapping) goes at once. ``entries[r]``: rank r's "shm:<node>:<name>"."""
    rank, size = ep.rank, len(entries)
    names = [e.rsplit(":", 1)[-1] for e in entries]
    if seg is None or size == 1 or len({e.rsplit(":", 1)[0] for e in entries}) != 1 or "-" in names:
        if seg is not None:
            shm.unlink(seg[0])
            seg[1].close()
        return None
    maps, channel = [], None
    try:
        for p, name in enumerate(names):
            maps.append(seg[1] if p == rank else shm.attach(name, shm.SLOT_BYTES))
        for p in range(size):  # their connections' monitors tell us a peer died
            if p != rank:
                ep.socket_to(p)
        channel = shm.Channel(ep, maps, names, shm.SLOT_BYTES, heartbeat_s)
        channel.attach_all()
    except BaseException:
        for name in names:  # a peer killed before its peers attached leaves nothing behind
            shm.unlink(name)
        if channel is not None:
            channel.close()
        raise
    return channel
