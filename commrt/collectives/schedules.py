"""Latency-optimal collective schedules as data (issue 32.1): pure functions, no sockets, no tensors.

Each builder returns, for one rank, its list of ``Step``s. A step sends one chunk range to one
peer and receives one chunk range from one peer (either may be absent), then applies what it
received: ``reduce`` into the own range or ``copy`` over it. The buffer is cut into ``parts``
chunks by ``algorithms.chunk_bounds(numel, parts)``; a range ``(lo, hi)`` names chunks
``lo..hi-1`` taken modulo ``parts`` (Bruck's blocks wrap around the end). A step's send reads the
buffer as it was before that step's receive is applied, so partners may exchange one range
both ways (recursive doubling): the executor must not write a range still being sent.

The algorithms and their sources:
  recursive doubling all_reduce, Rabenseifner all_reduce (reduce-scatter by recursive halving,
  all-gather by recursive doubling), binomial broadcast and reduce: Thakur, Rabenseifner & Gropp,
  "Optimization of collective communication operations in MPICH", IJHPCA 2005;
  Bruck all_gather: Bruck et al., IEEE TPDS 1997; dissemination barrier: Hensgen, Finkel &
  Manber 1988; the ring (``algorithms.py``) re-expressed as steps so one simulator replays all.

Worlds that are not a power of two use MPICH's fold: of the first ``2*rem`` ranks
(``rem = n - pof2``) each even rank sends its buffer to the odd rank above it and sits out; the
``pof2`` remaining ranks run the power-of-two algorithm; each odd rank then hands the result back.

Bit-identical results: every reduction combines two partial results of blocks of ranks, and
the operand holding the lower block is always the left one (``received_left``). Recursive
doubling and Rabenseifner (with the same fold) thus build the same expression tree for every
chunk on every rank, so all ranks, and both algorithms, agree bit for bit even in floating point.
The ring reduces each chunk in a chain starting after its owner: for integers the result equals
these, for floats it may differ in the last bits (another summation order), yet within one
algorithm all ranks hold the same bits, because each chunk is reduced once and then copied.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

from commrt.collectives.algorithms import (chain_order, dissemination_steps, pairwise_exchange_steps,
    ring_all_gather_steps, ring_neighbours, ring_reduce_scatter_steps)

REDUCE, COPY, NONE = "reduce", "copy", "none"


class Step(NamedTuple):
    send_to: int | None = None
    send: tuple[int, int] = (0, 0)       # chunks sent (modulo parts)
    recv_from: int | None = None
    recv: tuple[int, int] = (0, 0)       # chunks received (modulo parts)
    action: str = NONE                   # REDUCE into, COPY over the received range, or NONE
    received_left: bool = False          # REDUCE: op(received, own) instead of op(own, received)


class Schedule(NamedTuple):
    parts: int                  # the buffer is cut into chunk_bounds(numel, parts)
    ranks: list[list[Step]]     # ranks[r]: rank r's steps, in order


def pof2_below(n: int) -> int:
    """The largest power of two <= n (n >= 1)."""
    return 1 << (n.bit_length() - 1)


def _fold_rank(rank: int, n: int) -> int:
    """This rank's rank among the pof2 that run the core algorithm; -1 if it sits out."""
    rem = n - pof2_below(n)
    if rank < 2 * rem:
        return rank // 2 if rank % 2 else -1
    return rank - rem


def _real_rank(newrank: int, n: int) -> int:
    rem = n - pof2_below(n)
    return newrank * 2 + 1 if newrank < rem else newrank + rem


def _folded(rank: int, n: int, parts: int, core: Callable[[int, int], list[Step]]) -> list[Step]:
    """Wrap the power-of-two schedule ``core(newrank, pof2)`` (steps naming new ranks) in the fold."""
    rem, whole = n - pof2_below(n), (0, parts)
    if rank < 2 * rem and rank % 2 == 0:  # sits out: gives its buffer, gets the result back
        return [Step(send_to=rank + 1, send=whole), Step(recv_from=rank + 1, recv=whole, action=COPY)]
    newrank = _fold_rank(rank, n)
    steps = [s._replace(send_to=None if s.send_to is None else _real_rank(s.send_to, n),
                        recv_from=None if s.recv_from is None else _real_rank(s.recv_from, n))
             for s in core(newrank, pof2_below(n))]
    if rank < 2 * rem:  # odd: takes the even rank's buffer first (lower rank: the left operand)
        return [Step(recv_from=rank - 1, recv=whole, action=REDUCE, received_left=True), *steps,
                Step(send_to=rank - 1, send=whole)]
    return steps


def _doubling_core(newrank: int, pof2: int) -> list[Step]:
    steps, mask = [], 1
    while mask < pof2:
        peer = newrank ^ mask
        steps.append(Step(peer, (0, 1), peer, (0, 1), REDUCE, peer < newrank))
        mask <<= 1
    return steps


def recursive_doubling_all_reduce(rank: int, n: int) -> list[Step]:
    """ceil(log2 n) exchanges of the whole buffer (parts = 1); + 2 fold steps off powers of two."""
    return _folded(rank, n, 1, _doubling_core)


def _halving_core(newrank: int, pof2: int) -> list[Step]:
    """Reduce-scatter by recursive halving (partner distance 1, 2, 4, ...: the same pairs, so
    the same reduction tree, as recursive doubling), then all-gather retracing it backwards."""
    lo, hi, mask, scatter = 0, pof2, 1, []
    while mask < pof2:
        peer, mid = newrank ^ mask, (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if newrank < peer else ((mid, hi), (lo, mid))
        scatter.append(Step(peer, give, peer, keep, REDUCE, peer < newrank))
        lo, hi = keep
        mask <<= 1
    gather = []
    for s in reversed(scatter):
        # send what this rank holds (the range it kept), receive the partner's (what it gave)
        gather.append(Step(s.send_to, s.recv, s.recv_from, s.send, COPY))
    return scatter + gather


def rabenseifner_all_reduce(rank: int, n: int) -> list[Step]:
    """2 log2(pof2) steps moving 2 (pof2-1)/pof2 of the buffer; parts = pof2_below(n)."""
    return _folded(rank, n, pof2_below(n), _halving_core)


def ring_all_reduce(rank: int, n: int) -> list[Step]:
    """``algorithms.py``'s ring (reduce-scatter then all-gather, parts = n), as steps; reduces as
    ``ops.all_reduce`` does: op(own, received)."""
    left, right = ring_neighbours(rank, n)
    rs = [Step(right, (s, s + 1), left, (c, c + 1), REDUCE) for s, c in ring_reduce_scatter_steps(rank, n)]
    ag = [Step(right, (s, s + 1), left, (c, c + 1), COPY) for s, c in ring_all_gather_steps(rank, n)]
    return rs + ag


def binomial_broadcast(rank: int, n: int, root: int = 0) -> list[Step]:
    """Receive once from the parent, then send to children at halving distances (parts = 1)."""
    vr, mask, steps = (rank - root) % n, 1, []
    while mask < n:
        if vr & mask:
            steps.append(Step(recv_from=(vr - mask + root) % n, recv=(0, 1), action=COPY))
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if vr + mask < n:
            steps.append(Step(send_to=(vr + mask + root) % n, send=(0, 1)))
        mask >>= 1
    return steps


def binomial_reduce(rank: int, n: int, root: int = 0) -> list[Step]:
    """Receive from children at doubling distances, then send the partial sum to the parent.
    The own partial covers the lower block of (root-relative) ranks: it is the left operand."""
    vr, mask, steps = (rank - root) % n, 1, []
    while mask < n:
        if vr & mask:
            steps.append(Step(send_to=(vr - mask + root) % n, send=(0, 1)))
            break
        if vr + mask < n:
            steps.append(Step(recv_from=(vr + mask + root) % n, recv=(0, 1), action=REDUCE))
        mask <<= 1
    return steps


def ring_reduce(rank: int, n: int, root: int = 0) -> list[Step]:
    """``ops._ring_reduce_to``: ring reduce-scatter, then every rank sends its chunk to ``root``."""
    left, right = ring_neighbours(rank, n)
    steps = [Step(right, (s, s + 1), left, (c, c + 1), REDUCE) for s, c in ring_reduce_scatter_steps(rank, n)]
    if rank != root:
        return steps + [Step(send_to=root, send=(rank, rank + 1))]
    return steps + [Step(recv_from=src, recv=(src, src + 1), action=COPY) for src in range(n) if src != root]


def chain_broadcast(rank: int, n: int, root: int = 0, pieces: int = 1) -> list[Step]:
    """``ops.broadcast``'s pipelined chain: piece i is received while piece i-1 goes on."""
    chain = chain_order(root, n)
    pos = chain.index(rank)
    prev = chain[pos - 1] if pos else None
    nxt = chain[pos + 1] if pos + 1 < n else None
    if prev is None:
        return [Step(send_to=nxt, send=(i, i + 1)) for i in range(pieces)] if nxt is not None else []
    steps = []
    for i in range(pieces + 1):
        send = nxt is not None and i >= 1
        steps.append(Step(nxt if send else None, (i - 1, i) if send else (0, 0),
                          prev if i < pieces else None, (i, i + 1) if i < pieces else (0, 0),
                          COPY if i < pieces else NONE))
    return [s for s in steps if s.send_to is not None or s.recv_from is not None]


def bruck_all_gather(rank: int, n: int) -> list[Step]:
    """ceil(log2 n) steps (parts = n, rank r starts with chunk r): at distance d = 2^k send the
    min(d, n-d) chunks held from r on to r-d, receive those from r+d on. Absolute chunk indices,
    so no final rotation."""
    steps, dist = [], 1
    while dist < n:
        count = min(dist, n - dist)
        src = (rank + dist) % n
        steps.append(Step((rank - dist) % n, (rank, rank + count), src, (src, src + count), COPY))
        dist *= 2
    return steps


def ring_all_gather(rank: int, n: int) -> list[Step]:
    left, right = ring_neighbours(rank, n)
    return [Step(right, (s, s + 1), left, (c, c + 1), COPY) for s, c in ring_all_gather_steps(rank, n)]


def pairwise_all_to_all(rank: int, n: int) -> list[Step]:
    """n-1 steps (parts = n): ``send`` indexes the input, ``recv`` the output; the own chunk is
    a local copy, not a step."""
    return [Step(dst, (dst, dst + 1), src, (src, src + 1), COPY) for dst, src in pairwise_exchange_steps(rank, n)]


def dissemination_barrier(rank: int, n: int) -> list[Step]:
    return [Step(send_to=dst, recv_from=src) for dst, src in dissemination_steps(rank, n)]


# collective -> algorithm -> (builder(rank, n, root, pieces), parts(n, pieces))
_ONE = lambda n, p: 1  # noqa: E731
_N = lambda n, p: n  # noqa: E731
ALGORITHMS: dict[str, dict[str, tuple[Callable, Callable[[int, int], int]]]] = {
    "all_reduce": {
        "recursive_doubling": (lambda r, n, root, p: recursive_doubling_all_reduce(r, n), _ONE),
        "rabenseifner": (lambda r, n, root, p: rabenseifner_all_reduce(r, n), lambda n, p: pof2_below(n)),
        "ring": (lambda r, n, root, p: ring_all_reduce(r, n), _N)},
    "broadcast": {
        "binomial": (lambda r, n, root, p: binomial_broadcast(r, n, root), _ONE),
        "chain": (lambda r, n, root, p: chain_broadcast(r, n, root, p), lambda n, p: p)},
    "reduce": {
        "binomial": (lambda r, n, root, p: binomial_reduce(r, n, root), _ONE),
        "ring": (lambda r, n, root, p: ring_reduce(r, n, root), _N)},
    "all_gather": {
        "bruck": (lambda r, n, root, p: bruck_all_gather(r, n), _N),
        "ring": (lambda r, n, root, p: ring_all_gather(r, n), _N)},
    "all_to_all": {"pairwise": (lambda r, n, root, p: pairwise_all_to_all(r, n), _N)},
    "barrier": {"dissemination": (lambda r, n, root, p: dissemination_barrier(r, n), _ONE)},
}


def schedule(collective: str, algorithm: str, n: int, root: int = 0, pieces: int = 1) -> Schedule:
    """Every rank's steps; ``pieces`` only for the pipelined chain. KeyError names the unknown."""
    build, parts = ALGORITHMS[collective][algorithm]
    return Schedule(parts(n, pieces), [build(r, n, root, pieces) for r in range(n)])


def messages_sent(steps: list[Step]) -> int:
    return sum(s.send_to is not None for s in steps)
