"""Links shared fairly between the messages on them (``Network.sharing = "fair"``, issue 32.4).

A fluid model of how TCP divides a link: every message in flight is a flow; the flows on a
link share its bandwidth max-min fairly (progressive filling: the most contended link fixes its
flows at an equal share, the bandwidth they leave on their other links goes to the rest), and
the rates are recomputed whenever a flow starts or ends. A flow that crosses several links goes
at its bottleneck's share. First come, first served (``simulate._transmit``, the default) lets
the first message on a busy link leave at full rate and the next wait; here both go at half.

The rates are recomputed once per instant at which flows start or end (every rank of a lockstep
step starts its flow at the same time: one recomputation, not one per flow), and only for the
flows connected to the change through shared links, transitively: exact max-min for that
component; the others' rates do not change.

A node link with a token bucket (``Network.nic_burst``, tc's tbf) goes at the port's speed
(``intra_bw``) while its bucket holds at least a frame, and at ``nic_bw`` once it is empty; the
bucket refills at ``nic_bw`` less what the link sends. A bucket that refills while its link is
busy is looked at again at the next start or end of one of its flows (not the instant it holds a
frame again: that would be an event per frame).
"""
from __future__ import annotations

import heapq
import math
from collections import defaultdict

from commrt.plan.network import Link, Network

FRAME = 1514  # bytes: tbf sends a packet once it holds the packet's tokens
_NIC = ("nic_up", "nic_down")


class _Flow:
    __slots__ = ("links", "left", "rate", "since", "version")

    def __init__(self, links: tuple, size: float, now: float):
        self.links, self.left, self.rate, self.since, self.version = links, float(size), 0.0, now, 0


class Fluid:
    """The flows in flight over ``net``'s links and when each will end."""

    def __init__(self, net: Network):
        self.net, self.now = net, 0.0
        self.flows: dict = {}
        self.on: dict[Link, set] = defaultdict(set)
        self.events: list = []  # (time, seq, key, version): key a flow id, or ("bucket", link)
        self.seq = 0
        self.dirty: set = set()  # links whose flows changed at ``now``: rates recomputed once per instant
        # bucket link -> [tokens, when counted, bytes/s it sends, version]; a link never used is full
        self.bucket: dict[Link, list] = {}

    # -- the public face: start a flow, ask when the next thing happens, let it happen --

    def start(self, now: float, fid, links: tuple, size: float) -> None:
        """Flow ``fid`` of ``size`` bytes over ``links`` from ``now`` (not before the last event)."""
        assert now >= self.now - 1e-12 and fid not in self.flows, (now, self.now, fid)
        self._advance(now)
        self.flows[fid] = _Flow(links, size, self.now)
        for link in links:
            self.on[link].add(fid)
        self.dirty.update(links)

    def next_time(self, horizon: float = math.inf) -> float:
        """When the next flow ends or a bucket empties (inf: nothing in flight). Asked only about
        the present (``horizon`` <= now), it answers without bringing the rates up to date: the
        flows that start or end now change no rate before now."""
        if self.dirty and horizon > self.now:
            self._recompute()
        while self.events and not self._valid(self.events[0]):
            heapq.heappop(self.events)
        return self.events[0][0] if self.events else math.inf

    def step(self) -> tuple[float, list]:
        """Let the next event happen: (its time, the flows that ended then)."""
        when = self.next_time(self.now)
        if when > self.now:
            when = self.next_time()
        if when == math.inf:
            raise ValueError("Fluid.step: nothing in flight")
        _, _, key, _ = heapq.heappop(self.events)
        self._advance(when)
        if isinstance(key, tuple) and key and key[0] == "bucket":
            self.dirty.add(key[1])
            return self.now, []
        flow = self.flows.pop(key)
        for link in flow.links:
            self.on[link].discard(key)
        self.dirty.update(flow.links)
        return self.now, [key]

    # -- the model --

    def _valid(self, event) -> bool:
        _, _, key, version = event
        if isinstance(key, tuple) and key and key[0] == "bucket":
            return self.bucket[key[1]][3] == version
        flow = self.flows.get(key)
        return flow is not None and flow.version == version

    def _push(self, when: float, key, version: int) -> None:
        self.seq += 1
        heapq.heappush(self.events, (when, self.seq, key, version))

    def _component(self, links) -> tuple[set, set]:
        """The flows reachable from ``links`` through shared links, and every link they cross."""
        flows, seen, todo = set(), set(links), list(links)
        while todo:
            for fid in self.on.get(todo.pop(), ()):
                if fid not in flows:
                    flows.add(fid)
                    for link in self.flows[fid].links:
                        if link not in seen:
                            seen.add(link)
                            todo.append(link)
        return flows, seen

    def _capacity(self, link: Link) -> float:
        kind = link[0]
        if kind in ("out", "in"):
            return self.net.intra_bw
        if kind in _NIC:
            full = self.net.nic_burst and self._tokens(link) >= min(FRAME, self.net.nic_burst)
            return self.net.intra_bw if full else self.net.nic_bw
        return self.net.spine_bw

    def _tokens(self, link: Link) -> float:
        """The bucket's tokens now (counted since it was last looked at)."""
        state = self.bucket.setdefault(link, [self.net.nic_burst, self.now, 0.0, 0])
        tokens, since, sending, _ = state
        state[0] = min(self.net.nic_burst, max(0.0, tokens + (self.net.nic_bw - sending) * (self.now - since)))
        state[1] = self.now
        return state[0]

    def _advance(self, now: float) -> None:
        """Time moves on: the rates of the instant before are brought up to date first."""
        if now > self.now:
            if self.dirty:
                self._recompute()
            self.now = now

    def _recompute(self) -> None:
        """Max-min rates for the flows connected to the changed links; ends (and buckets) rescheduled."""
        flows, touched = self._component(self.dirty)
        self.dirty = set()
        buckets = [link for link in touched if link[0] in _NIC] if self.net.nic_burst else []
        for link in buckets:
            self._tokens(link)  # count what the old rates sent
        for fid in flows:
            flow = self.flows[fid]
            flow.left = max(0.0, flow.left - flow.rate * (self.now - flow.since))
            flow.since = self.now
        for fid, rate in _max_min({fid: self.flows[fid].links for fid in flows}, self._capacity).items():
            flow = self.flows[fid]
            flow.rate, flow.version = rate, flow.version + 1
            self._push(self.now + flow.left / rate, fid, flow.version)
        for link in buckets:
            state = self.bucket[link]
            state[2], state[3] = sum(self.flows[f].rate for f in self.on.get(link, ())), state[3] + 1
            if state[2] > self.net.nic_bw and state[0] > 0:  # sending at the port's speed: empties
                self._push(self.now + state[0] / (state[2] - self.net.nic_bw), ("bucket", link), state[3])


def _max_min(flows: dict, capacity) -> dict:
    """Progressive filling: {flow: links} -> {flow: rate}. The link whose remaining capacity per
    unfixed flow is least fixes its flows at that share; repeat with what is left (a heap of the
    links' shares: a link's share only grows as flows elsewhere are fixed below it)."""
    left: dict = {}
    count: dict = defaultdict(int)
    on: dict = defaultdict(list)
    for fid, links in flows.items():
        for link in links:
            if link not in left:
                left[link] = capacity(link)
            count[link] += 1
            on[link].append(fid)
    version = dict.fromkeys(left, 0)
    heap = [(left[link] / count[link], 0, link) for link in left]
    heapq.heapify(heap)
    rates: dict = {}
    while heap:
        share, ver, link = heapq.heappop(heap)
        if ver != version[link] or not count[link]:
            continue
        for fid in on[link]:
            if fid in rates:
                continue
            rates[fid] = share
            for other in flows[fid]:
                left[other] = max(0.0, left[other] - share)
                count[other] -= 1
                version[other] += 1
                if count[other] and other != link:
                    heapq.heappush(heap, (left[other] / count[other], version[other], other))
    return rates
