"""Pure schedule arithmetic for the collectives: no sockets, no tensors, exhaustively tested.

Ring conventions (Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
workstations", 2009): a buffer is cut into ``n`` chunks; in ``n-1`` steps every rank sends one
chunk to its right neighbour and receives one from its left. Reduce-scatter leaves the fully
reduced chunk ``r`` on rank ``r``; all-gather then circulates each owner's chunk.
"""
from __future__ import annotations


def chunk_bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """Split ``range(numel)`` into ``parts`` contiguous ranges; the first ``numel % parts``
    ranges get one extra element. Empty ranges are allowed (numel < parts)."""
    if parts <= 0 or numel < 0:
        raise ValueError(f"chunk_bounds needs numel >= 0 and parts > 0, got {numel}, {parts}")
    base, extra = divmod(numel, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def pieces(start: int, end: int, max_elems: int) -> list[tuple[int, int]]:
    """Cut ``[start, end)`` into pipelining pieces of at most ``max_elems`` elements."""
    max_elems = max(1, max_elems)
    return [(s, min(s + max_elems, end)) for s in range(start, end, max_elems)]


def ring_neighbours(rank: int, world_size: int) -> tuple[int, int]:
    """(left, right): receive from the left, send to the right."""
    return (rank - 1) % world_size, (rank + 1) % world_size


def ring_reduce_scatter_steps(rank: int, world_size: int) -> list[tuple[int, int]]:
    """Per step, (chunk sent right, chunk received from left and reduced).

    Offset so that after ``n-1`` steps rank ``r`` holds the fully reduced chunk ``r``, which
    is what ``reduce_scatter_tensor`` promises. The chunk received at step ``k`` is the one
    sent at step ``k+1``: that is what lets pieces flow straight through the pipeline.
    """
    n = world_size
    return [((rank - k - 1) % n, (rank - k - 2) % n) for k in range(n - 1)]


def ring_all_gather_steps(rank: int, world_size: int) -> list[tuple[int, int]]:
    """Per step, (chunk sent right, chunk received from left); rank ``r`` starts owning ``r``."""
    n = world_size
    return [((rank - k) % n, (rank - k - 1) % n) for k in range(n - 1)]


def chain_order(src: int, world_size: int) -> list[int]:
    """Broadcast chain starting at ``src``: src -> src+1 -> ... (pipelined in pieces)."""
    return [(src + i) % world_size for i in range(world_size)]


def pairwise_exchange_steps(rank: int, world_size: int) -> list[tuple[int, int]]:
    """All-to-all: at step k send to rank+k and receive from rank-k (k = 1..n-1)."""
    n = world_size
    return [((rank + k) % n, (rank - k) % n) for k in range(1, n)]


def dissemination_steps(rank: int, world_size: int) -> list[tuple[int, int]]:
    """Barrier (Hensgen, Finkel & Manber 1988): round k sends to rank+2^k, receives from rank-2^k.
    After ceil(log2 n) rounds every rank has (transitively) heard from every other."""
    steps, dist = [], 1
    while dist < world_size:
        steps.append(((rank + dist) % world_size, (rank - dist) % world_size))
        dist *= 2
    return steps
