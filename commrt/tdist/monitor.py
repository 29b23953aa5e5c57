"""``monitored_barrier``: like gloo's, rank 0 collects one message from every rank and names
those that did not arrive in time; then it releases everyone. Runs on point-to-point messages
with a tag above torch's range, so it never matches a user's transfer."""
from __future__ import annotations

import time

import torch

from ..errors import CommError
from ..work import CommTimeout


def monitored_barrier(backend, rank: int, size: int, members: list[int], timeout_s: float | None,
                      wait_all_ranks: bool, tag: int) -> None:
    limit = timeout_s if timeout_s is not None else backend.cfg.comm.timeout_s
    token = torch.zeros(1, dtype=torch.uint8)
    if rank != 0:
        backend.isend(token, 0, tag)
        _wait(backend.irecv(torch.zeros(1, dtype=torch.uint8), 0, tag), limit,
              f"rank {members[rank]}: monitored_barrier: no release from rank {members[0]} within {limit:g}s")
        return
    works = {r: backend.irecv(torch.zeros(1, dtype=torch.uint8), r, tag) for r in range(1, size)}
    deadline, missing = time.monotonic() + limit, []
    for r, work in works.items():
        try:
            work.wait(max(0.0, deadline - time.monotonic()))
        except CommTimeout:
            missing.append(members[r])
            if not wait_all_ranks:
                break
    if missing:
        which = ", ".join(str(r) for r in missing)
        raise CommError(f"Ranks {which} failed to pass monitoredBarrier in {limit:g}s "
                        f"(rank {members[0]} waited for them)")
    for r in range(1, size):
        backend.isend(token, r, tag).wait()


def _wait(work, limit: float, message: str) -> None:
    try:
        work.wait(limit)
    except CommTimeout:
        raise CommError(message) from None
