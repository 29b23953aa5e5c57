"""Replay collective schedules over a network model (issue 32.4): time and per-link load.

The schedules are the ones the executors run (``collectives/schedules.py``, which re-expresses
``algorithms.py``'s ring and chain as steps), not a formula. Every rank walks its steps: a
step's send leaves when the rank reaches it and takes every link of its path at once for
bytes / bottleneck bandwidth, after whatever the links already carry (first come, first served,
in time order); or, with ``Network.sharing = "fair"``, becomes a flow that shares each link
max-min fairly with the others in flight (``plan/links.py``) and leaves when its bytes are through.
It arrives a path latency later. The step ends when its send has left and its
receive has arrived (a blocking sendrecv), plus the reduction if ``reduce_bw`` is set; the
pairwise all_to_all's steps are taken as its executor takes them, every send, then every
receive (``_as_executed``). With the
network's CPU term (``Network.cpu_msg``, ``cpu_byte``, ``cores``) a send first takes its CPU
time, a receive its own after arrival, on the host's shared cores (``_Cores``).

Long schedules (the ring and pairwise all_to_all take n-1 steps per phase, 537 M rank-steps at
16,384 ranks) are replayed over their first ``k`` and ``2k`` steps of each phase and the
remaining steps extended at the per-step time and load between the two: every step of these
schedules moves the same chunk size in the same pattern (to the neighbour, or to the peer k
away), so the per-step cost is steady. ``Result.replayed`` says how much was replayed.
"""
from __future__ import annotations

import heapq
import math
from collections import defaultdict, deque
from typing import NamedTuple

from commrt.collectives.algorithms import chunk_bounds, pieces as cut_pieces
from commrt.collectives.schedules import ALGORITHMS, REDUCE, Schedule, Step, schedule
from commrt.plan.links import Fluid
from commrt.plan.network import Network
from commrt.runtime.errors import ConfigError

MAX_RANK_STEPS = 60_000  # beyond this, steady-state extension (~20 us of Python per rank-step)
HARD_LIMIT = 3_000_000   # rank-steps replayed at most (an unextendable schedule beyond: ValueError)
# schedules whose steps are uniform: phases of n-1 steps each
_PHASES = {("all_reduce", "ring"): 2, ("all_gather", "ring"): 1, ("all_to_all", "pairwise"): 1}


class Result(NamedTuple):
    collective: str
    algorithm: str
    world: int
    nbytes: int
    seconds: float
    link_bytes: dict          # (kind, index) -> bytes carried
    messages: int             # sent, all ranks together
    bytes_sent: int           # sent, all ranks together
    replayed: float           # fraction of the rank-steps replayed (1.0: all)


def _range_bytes(prefix: list[int], parts: int, rng: tuple[int, int], itemsize: int) -> int:
    lo, hi = rng
    if hi <= lo:
        return 0
    start = lo % parts
    end = start + (hi - lo)
    elems = prefix[min(end, parts)] - prefix[start] + (prefix[end - parts] if end > parts else 0)
    return elems * itemsize


class _Cores:
    """When each host's cores free up (``Network.cores`` > 0): a piece of CPU work starts on the
    core that frees first, not before it is ready. Without cores every rank has its own."""

    def __init__(self, net: Network):
        self.net, self.free = net, defaultdict(lambda: [0.0] * net.cores)

    def run(self, rank: int, ready: float, seconds: float) -> float:
        """When ``seconds`` of ``rank``'s CPU work, ready at ``ready``, is done."""
        if seconds <= 0 or not self.net.cores:
            return ready + seconds
        cores = self.free[self.net.host(rank)]
        i = min(range(len(cores)), key=cores.__getitem__)
        cores[i] = max(ready, cores[i]) + seconds
        return cores[i]


def replay(net: Network, sched: Schedule, numel: int, itemsize: int = 4,
           bounds: list[tuple[int, int]] | None = None, piece_bytes: int = 4 << 20) -> tuple[float, dict, int, int]:
    """(seconds until the last rank finishes, link -> bytes, messages, bytes sent). ``bounds``:
    the element range of each of the schedule's chunks (default ``chunk_bounds(numel, parts)``);
    a step's range travels as the executor's messages (``_messages``) of at most ``piece_bytes``."""
    return _Replay(net, sched, numel, itemsize, bounds, piece_bytes).run()


class _Replay:
    """Every rank walking its steps, in time order. First come, first served: a send's end is
    known when it starts (``_transmit``). Fair sharing: it is known when the flow ends (``Fluid``),
    so the sender waits for that event, and the links' events interleave with the ranks'."""

    def __init__(self, net: Network, sched: Schedule, numel: int, itemsize: int, bounds=None,
                 piece_bytes: int = 4 << 20):
        self.net, (self.parts, self.ranks), self.itemsize = net, sched, itemsize
        self.piece_elems = max(1, piece_bytes // itemsize)
        self.prefix = [0]
        for a, b in bounds or chunk_bounds(numel, self.parts):
            self.prefix.append(self.prefix[-1] + b - a)
        self.free, self.load, self.cpu = defaultdict(float), defaultdict(float), _Cores(net)
        self.fluid = Fluid(net) if net.sharing == "fair" else None
        self.chan, self.waiting, self.flying = defaultdict(deque), {}, {}
        n = len(self.ranks)
        self.pos, self.clock, self.sent_at, self.got, self.ready_at = [0] * n, [0.0] * n, [None] * n, [None] * n, [None] * n
        self.heap = [(0.0, r) for r in range(n)]
        self.messages = self.sent = 0

    def run(self) -> tuple[float, dict, int, int]:
        heap, fluid = self.heap, self.fluid
        while heap or (fluid is not None and fluid.next_time() < math.inf):
            top = heap[0][0] if heap else math.inf
            if fluid is not None and fluid.next_time(top) <= top:
                when, ended = fluid.step()
                for r in ended:
                    self._left(r, when)
                continue
            self._walk(heapq.heappop(heap)[1])
        assert not self.waiting and all(p == len(st) for p, st in zip(self.pos, self.ranks)), "schedule deadlocked"
        return max(self.clock, default=0.0), dict(self.load), self.messages, self.sent

    def _messages(self, rng: tuple[int, int]) -> int:
        """The messages ``scheduled.run`` sends a step's range as: its contiguous spans (a range
        that wraps past the last chunk: two) cut into pieces of ``piece_elems``; an empty range
        still one (``scheduled.step_pieces``)."""
        lo, hi = rng
        start, end = lo % self.parts, lo % self.parts + max(0, hi - lo)
        spans = [self.prefix[min(end, self.parts)] - self.prefix[start]]
        if end > self.parts:
            spans.append(self.prefix[end - self.parts])
        return max(1, sum(-(-e // self.piece_elems) for e in spans))

    def _before(self, t: float) -> bool:
        """Whether something happens to another rank or a link before ``t``."""
        if self.heap and self.heap[0][0] < t:
            return True
        return self.fluid is not None and self.fluid.next_time(t) < t

    def _walk(self, r: int) -> None:
        """Rank r's steps from where it stands, until it waits or another event comes first."""
        steps = self.ranks[r]
        while self.pos[r] < len(steps):
            s, t = steps[self.pos[r]], self.clock[r]
            if s.send_to is not None and self.sent_at[r] is None and not self._send(r, s, t):
                return  # fair sharing: in flight until its flow ends
            done = t if self.sent_at[r] is None else self.sent_at[r]
            if s.recv_from is not None:
                if self.got[r] is None:
                    queue = self.chan[s.recv_from, r]
                    if not queue:
                        self.waiting[s.recv_from, r] = r
                        return
                    self.got[r] = max(done, queue.popleft())
                    if self.net.cores and self._before(self.got[r]):  # cores shared: take them in time order
                        heapq.heappush(self.heap, (self.got[r], r))
                        return
                recv = _range_bytes(self.prefix, self.parts, s.recv, self.itemsize)
                done = self.cpu.run(r, self.got[r], _recv_cpu(self.net, s, recv, self._messages(s.recv)))
            self.clock[r], self.sent_at[r], self.got[r] = done, None, None
            self.pos[r] += 1
            if self._before(done):  # keep sends in time order: let the earlier ranks go first
                heapq.heappush(self.heap, (done, r))
                return

    def _send(self, r: int, s: Step, t: float) -> bool:
        """Start step s's send at ``t``; True if its end is known (first come, first served)."""
        net, size = self.net, _range_bytes(self.prefix, self.parts, s.send, self.itemsize)
        links, lat, bw = net.route(r, s.send_to)
        msgs = self._messages(s.send)
        if self.ready_at[r] is None:
            self.ready_at[r] = self.cpu.run(r, t, net.cpu_seconds(size, msgs) if net.cpu_modelled else 0.0)
            if self.fluid is not None and self._before(self.ready_at[r]):  # a flow starts in time order
                heapq.heappush(self.heap, (self.ready_at[r], r))
                return False
        for link in links:
            self.load[link] += size
        self.messages, self.sent = self.messages + msgs, self.sent + size
        if self.fluid is not None:
            self.fluid.start(self.ready_at[r], r, links, size)
            self.flying[r] = (s.send_to, lat)
            return False
        self.sent_at[r] = _transmit(net, self.free, links, self.ready_at[r], size, bw)
        self.ready_at[r] = None
        self._deliver(r, s.send_to, self.sent_at[r] + lat)
        return True

    def _left(self, r: int, when: float) -> None:
        """Rank r's flow has left at ``when``: its step goes on, its message arrives."""
        dst, lat = self.flying.pop(r)
        self.sent_at[r], self.ready_at[r] = when, None
        self._deliver(r, dst, when + lat)
        heapq.heappush(self.heap, (when, r))

    def _deliver(self, src: int, dst: int, arrival: float) -> None:
        self.chan[src, dst].append(arrival)
        woken = self.waiting.pop((src, dst), None)
        if woken is not None:
            heapq.heappush(self.heap, (self.clock[woken], woken))


def _transmit(net: Network, free: dict, links: tuple, ready: float, size: int, bw: float) -> float:
    """When the last byte of a message ready at ``ready`` has left over ``links`` (first come,
    first served; ``free``: when each link is next free). A node link with a token bucket
    (``nic_burst``) keeps a virtual clock that may lag real time by burst / nic_bw: the bytes its
    idle time saved up go at the port's speed (tbf with no peak rate)."""
    nic = [link for link in links if link[0] in ("nic_up", "nic_down")]
    if not net.nic_burst or not nic:
        start = max(ready, max(free[link] for link in links))
        for link in links:
            free[link] = start + size / bw
        return start + size / bw
    others = [link for link in links if link not in nic]
    start = max([ready] + [free[link] for link in others])
    peak = min(net.intra_bw, net.spine_bw if len(links) > 4 else net.intra_bw)
    saved = start - net.nic_burst / net.nic_bw  # a link never used has a full bucket
    virtual = max(max(free.get(link, saved) for link in nic), saved) + size / net.nic_bw
    done = max(start + size / peak, virtual)
    for link in links:
        free[link] = virtual if link in nic else done
    return done


def _recv_cpu(net: Network, step: Step, nbytes: int, messages: int = 1) -> float:
    """CPU seconds a step's receive costs: taking its messages in, and reducing them into the buffer."""
    reduce = nbytes / net.reduce_bw if step.action == REDUCE and net.reduce_bw else 0.0
    return (net.cpu_seconds(nbytes, messages) if net.cpu_modelled else 0.0) + reduce


def _as_executed(collective: str, algorithm: str, sched: Schedule) -> Schedule:
    """The steps in the order the executor takes them: the pairwise all_to_all's sends read only
    the input, so ``ops.all_to_all`` queues all of them, then takes the receives
    (``scheduled.run(sends_first=True)``: one latency, not n-1); the others step by step."""
    if (collective, algorithm) != ("all_to_all", "pairwise"):
        return sched
    return sched._replace(ranks=[[Step(send_to=s.send_to, send=s.send) for s in st]
                                 + [Step(recv_from=s.recv_from, recv=s.recv, action=s.action) for s in st]
                                 for st in sched.ranks])


def _rotated(step: Step, r: int, n: int) -> Step:
    """Rank 0's step as rank r takes it in a rotation-symmetric schedule (ring, pairwise):
    peers and chunks shifted by r (chunk ranges are taken modulo parts = n)."""
    def shift(rng):
        return (rng[0] + r) % n, (rng[0] + r) % n + rng[1] - rng[0]
    return step._replace(send_to=None if step.send_to is None else (step.send_to + r) % n, send=shift(step.send),
                         recv_from=None if step.recv_from is None else (step.recv_from + r) % n,
                         recv=shift(step.recv))


def truncated(collective: str, algorithm: str, n: int, k: int, phases: int) -> Schedule:
    """The first ``k`` steps of each of the ``phases`` phases of n-1 steps. Built from rank 0's
    schedule, rotated: building every rank's whole ring at 16,384 ranks is 537 M steps."""
    build, parts = ALGORITHMS[collective][algorithm]
    first = [s for ph in range(phases) for s in build(0, n, 0, 1)[ph * (n - 1):ph * (n - 1) + k]]
    return Schedule(parts(n, 1), [[_rotated(s, r, n) for s in first] for r in range(n)])


def simulate(net: Network, collective: str, algorithm: str, nbytes: int, itemsize: int = 4,
             root: int = 0, piece_bytes: int = 4 << 20, max_rank_steps: int = MAX_RANK_STEPS,
             repeat: int = 1) -> Result:
    """Replay ``algorithm`` for ``collective`` of ``nbytes`` per rank over ``net``; ``repeat``
    back to back (as a benchmark's loop: a rank starts the next op when it finished its part)."""
    n, numel = net.world, nbytes // itemsize
    piece_elems = max(1, piece_bytes // itemsize)
    pieces = max(1, -(-numel // piece_elems))
    phases = _PHASES.get((collective, algorithm))
    k = max(2, max_rank_steps // (2 * phases * n)) if phases else 0
    # whole when the extension's k and 2k steps (3k) would replay as much: it was extrapolated
    # then, at more cost than the exact replay, and reported as more than all of it replayed
    if phases is None or phases * (n - 1) * n <= max_rank_steps or n < 8 or 3 * k >= n - 1:
        if phases is None and algorithm in ("ring", "chain") and n * n > HARD_LIMIT:
            # ConfigError (a ValueError): ``commrt estimate --simulate --worlds`` reaches it
            raise ConfigError(f"{collective}/{algorithm} at {n} ranks: {n}^2 rank-steps is beyond what "
                              f"the simulator replays ({HARD_LIMIT}) and its steps are not uniform; "
                              f"leave it out with --algorithms")
        # Rabenseifner's 2 log n steps a rank; the chain's pieces + 1 (only its steps grow with the
        # size: the others' ranges go as more messages of one step, _Replay._messages)
        chain = (collective, algorithm) == ("broadcast", "chain")
        log_steps = n * (pieces + 1 if chain else 2 * max(1, (n - 1).bit_length()))
        if phases is None and log_steps > HARD_LIMIT:  # 100,000 ranks took 39 s, 10^6 minutes and GBs
            where = f"{n} ranks" + (f" in {pieces} pieces" if chain else "")
            raise ConfigError(f"{collective}/{algorithm} at {where}: about {log_steps} "
                              f"rank-steps is beyond what the simulator replays ({HARD_LIMIT}); "
                              "simulate fewer ranks (the tables go to 16,384) or a smaller size")
        parts, steps = _as_executed(collective, algorithm, schedule(collective, algorithm, n, root, pieces))
        # the chain's pieces as ops.broadcast cuts them: whole pieces of piece_bytes, the last one
        # short (5 MiB: 4 + 1 MiB). chunk_bounds(numel, pieces) made them equal (2.5 + 2.5), which
        # predicted 5 MiB faster than 4 MiB; the other schedules cut the buffer in chunk_bounds
        bounds = (cut_pieces(0, numel, piece_elems) or [(0, 0)]) if chain else None
        secs, load, msgs, sent = replay(net, Schedule(parts, [s * repeat for s in steps]), numel, itemsize,
                                        bounds, piece_bytes)
        return Result(collective, algorithm, n, nbytes, secs, load, msgs, sent, 1.0)
    if repeat != 1:
        raise ValueError(f"repeat={repeat}: {collective}/{algorithm} at {n} ranks is replayed in part; repeat needs a full replay")
    total_steps = phases * (n - 1) * n
    first, second = (replay(net, _as_executed(collective, algorithm, truncated(collective, algorithm, n, j, phases)),
                            numel, itemsize, piece_bytes=piece_bytes) for j in (k, 2 * k))
    scale = (n - 1 - k) / k  # the steps not in the first k, per the k steps between k and 2k
    secs = first[0] + (second[0] - first[0]) * scale
    load = {link: first[1].get(link, 0.0) + (second[1][link] - first[1].get(link, 0.0)) * scale
            for link in second[1]}
    msgs = round(first[2] + (second[2] - first[2]) * scale)
    sent = round(first[3] + (second[3] - first[3]) * scale)
    return Result(collective, algorithm, n, nbytes, secs, load, msgs, sent, 3 * k * phases * n / total_steps)


def load_by_kind(link_bytes: dict) -> dict[str, dict[str, float]]:
    """Per kind of link: how many carried anything, their total and the busiest one's bytes."""
    out: dict[str, dict[str, float]] = {}
    for (kind, _), b in link_bytes.items():
        agg = out.setdefault(kind, {"links": 0, "total_bytes": 0.0, "max_bytes": 0.0})
        agg["links"] += 1
        agg["total_bytes"] += b
        agg["max_bytes"] = max(agg["max_bytes"], b)
    return out
