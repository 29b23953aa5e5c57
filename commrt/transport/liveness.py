"""Which peers of an Endpoint are gone, and the errors that name them.

A monitor on each outgoing connection reports when a peer's connection drops (its process
died, or it stopped answering ZMTP heartbeats: SIGSTOP, a hung host). The owner of the
endpoint reads the monitors once a slice; a connection down for longer than the grace (one
heartbeat interval, so a reconnect can still come back) is a lost peer. The collective
endpoint, the shared-memory channel and the point-to-point engine all decide it here.
"""
from __future__ import annotations

import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from commrt.runtime.errors import PeerLost

EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_CONNECT_RETRIED


class Liveness:
    """One endpoint's view of its peers' connections (owned like the endpoint)."""

    def __init__(self, slice_s: float, grace_s: float, timeout_s: float):
        self.slice_s, self.grace_s, self.timeout_s = slice_s, grace_s, timeout_s
        self.down: dict[int, float] = {}  # peer -> when its connection dropped
        self.gone: set[int] = set()  # peers that said goodbye (closed the group on purpose)
        self._monitors: dict[zmq.Socket, int] = {}
        self._watched_at = 0.0

    def monitor(self, sock: zmq.Socket, peer: int) -> None:
        """Watch ``sock``, the connection to ``peer``."""
        self._monitors[sock.get_monitor_socket(EVENTS)] = peer

    def watch(self) -> None:
        """Read every monitor's pending events."""
        for mon, peer in self._monitors.items():
            while True:
                try:
                    event = recv_monitor_message(mon, zmq.NOBLOCK)["event"]
                except zmq.Again:
                    break
                if event in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CONNECT_RETRIED):  # retried: refused
                    self.down.setdefault(peer, time.monotonic())
                elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self.down.pop(peer, None)

    def left(self, peer: int) -> None:
        """``peer`` closed its end on purpose: its connection's drop is no one's fault, so the
        errors below never name it in place of the peer a rank waits on."""
        self.gone.add(peer)

    def watch_if_due(self, now: float) -> bool:
        """``watch`` once a slice (for owners that poll in their own loop); True when it ran."""
        if now - self._watched_at < self.slice_s:
            return False
        self._watched_at = now
        self.watch()
        return True

    def is_lost(self, peer: int, now: float) -> bool:
        """Whether ``peer``'s connection dropped longer than the grace ago."""
        since = self.down.get(peer)
        return since is not None and now - since > self.grace_s

    def lost(self, src: int, op: str, seq: int, now: float) -> PeerLost:
        """``src`` is gone. If another peer dropped shortly before, that one went first and
        ``src`` most likely gave up because of it (a survivor that raised and exited): name it."""
        recent = {p: t for p, t in self.down.items() if now - t <= self.timeout_s and p not in self.gone}
        first = min(recent, key=recent.get) if recent else src
        why = "process ended, or stopped answering heartbeats"
        if first == src:
            if src in self.gone:
                why = "it closed the group while this rank waited on it"
            return PeerLost(src, op, seq, f"connection lost {now - self.down[src]:.2f}s ago ({why})")
        return PeerLost(first, op, seq, f"connection lost {now - self.down[first]:.2f}s ago ({why}); "
                        f"rank {src}, which this rank was waiting on, dropped after it")

    def timeout(self, src: int, op: str, seq: int, limit: float) -> PeerLost:
        """Nothing from ``src`` in time: if another peer's connection dropped, that rank is the
        likelier culprit (we wait on a neighbour that waits on it), so name it."""
        gone = sorted((p for p in self.down if p not in self.gone), key=self.down.get)
        if gone:
            return PeerLost(gone[0], op, seq, f"no message from rank {src} within {limit:g}s, and rank "
                            f"{gone[0]}'s connection was lost {time.monotonic() - self.down[gone[0]]:.2f}s ago")
        return PeerLost(src, op, seq, f"timeout after {limit:g}s: no message from it")

    def close(self) -> None:
        for mon in self._monitors:
            mon.close(linger=0)
        self._monitors.clear()
