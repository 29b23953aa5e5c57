"""``monitored_barrier``: like gloo's, rank 0 collects one message from every rank and names
those that did not arrive in time; then it releases everyone. Runs on point-to-point messages
with a tag above torch's range, so it never matches a user's transfer.

The error texts are gloo's (``ProcessGroupGloo::monitoredBarrier``), because code and tests
written for ``torch.distributed.monitored_barrier`` match on them: "Rank 1 failed to pass
monitoredBarrier", "Ranks 1, 2 failed ..." (``wait_all_ranks``), "Rank 0 timed out in
monitoredBarrier" (rank 0's own time ran out before it heard from a rank), and on the other
ranks "Rank r successfully reached monitoredBarrier, but received errors while waiting for
send/recv from rank 0". Ranks are named by their global rank.

torch's ``dist.monitored_barrier`` refuses every backend not named gloo before it reaches the
process group; ``route_torch_api`` wraps it so that on a commrt group it calls the group's
``monitored_barrier`` (and on any other group torch's own function, unchanged).
"""
from __future__ import annotations

import time
import weakref

import torch

from commrt.runtime.errors import CommError, PeerLost
from commrt.runtime.work import CommTimeout


class MonitoredBarrierError(CommError):
    """A rank did not reach ``monitored_barrier`` in time (or rank 0 never released this one)."""


def seconds(timeout) -> float | None:
    """torch's timeout argument (a timedelta or seconds) -> seconds, None for the default;
    zero or less stays zero: rank 0 times out at once, as on gloo."""
    if timeout is None:
        return None
    value = timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout)
    return max(0.0, value)


class _Channel:
    """One group's barrier channel on this rank. A failed barrier leaves receives posted (there
    is no withdrawing one); they stay first in line for their peer, so later barriers use them
    before posting more, and every message carries the barrier's generation (each rank counts
    its calls) so a late one from a failed barrier is recognised and skipped."""

    def __init__(self):
        self.generation = 0
        self.pending: dict[int, list] = {}  # peer -> [(Work, buffer)] posted and not yet used

    def post(self, backend, peer: int, tag: int) -> None:
        if not self.pending.get(peer):
            buf = torch.zeros(1, dtype=torch.int64)
            self.pending.setdefault(peer, []).append((backend.irecv(buf, peer, tag), buf))

    def ready(self, peer: int) -> bool:
        return bool(self.pending.get(peer)) and self.pending[peer][0][0].is_completed()

    def take(self, backend, peer: int, tag: int, timeout: float, members: list[int]) -> None:
        """Wait for ``peer``'s message of this generation; raises CommTimeout or PeerLost."""
        deadline = time.monotonic() + timeout
        while True:
            self.post(backend, peer, tag)
            work, buf = self.pending[peer][0]
            try:
                work.wait(max(0.0, deadline - time.monotonic()))
            finally:
                if work.is_completed():
                    self.pending[peer].pop(0)
            got = int(buf.item())
            if got == self.generation:
                return
            if got > self.generation:
                raise MonitoredBarrierError(f"rank {members[peer]} is at its monitored_barrier call {got} on this "
                                            f"group, this rank at call {self.generation}: the ranks' calls differ")


_CHANNELS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # backend -> {tag: _Channel}


def monitored_barrier(backend, rank: int, size: int, members: list[int], timeout_s: float | None,
                      wait_all_ranks: bool, tag: int) -> None:
    limit = timeout_s if timeout_s is not None else backend.cfg.comm.timeout_s
    chan = _CHANNELS.setdefault(backend, {}).setdefault(tag, _Channel())
    chan.generation += 1
    token = torch.tensor([chan.generation], dtype=torch.int64)
    if rank != 0:
        backend.isend(token, 0, tag)
        try:
            chan.take(backend, 0, tag, limit, members)
        except (CommTimeout, PeerLost) as exc:
            raise MonitoredBarrierError(
                f"Rank {members[rank]} successfully reached monitoredBarrier, but received errors while waiting "
                f"for send/recv from rank {members[0]} ({_why(exc, limit)}). Please check rank "
                f"{members[0]}'s log for the faulty rank.") from None
        return
    _collect(backend, chan, size, members, limit, wait_all_ranks, tag)
    for r in range(1, size):
        backend.isend(token, r, tag).wait()


def _collect(backend, chan: _Channel, size: int, members: list[int], limit: float, wait_all_ranks: bool,
             tag: int) -> None:
    """Rank 0: one token from every other rank before the shared deadline, in rank order."""
    for r in range(1, size):
        chan.post(backend, r, tag)
    deadline, passed, missing = time.monotonic() + limit, [], []
    for r in range(1, size):
        left = deadline - time.monotonic()
        if left <= 0 and not chan.ready(r) and not wait_all_ranks:
            done = ", ".join(str(members[p]) for p in passed) or "none"
            raise MonitoredBarrierError(f"Rank {members[0]} timed out in monitoredBarrier after {limit * 1e3:.0f} ms "
                                        f"(ranks that passed: {done}; rank {members[r]} had not arrived)")
        try:
            chan.take(backend, r, tag, max(0.0, left), members)
            passed.append(r)
        except (CommTimeout, PeerLost) as exc:  # a rank that left the group never arrives either
            missing.append((members[r], _why(exc, limit)))
            if not wait_all_ranks:
                raise MonitoredBarrierError(f"Rank {members[r]} failed to pass monitoredBarrier in "
                                            f"{limit * 1e3:.0f} ms (rank {members[0]} waited: {missing[0][1]})") from None
    if missing:
        why = "; ".join(f"rank {r}: {w}" for r, w in missing)
        raise MonitoredBarrierError(f"Ranks {', '.join(str(r) for r, _ in missing)} failed to pass monitoredBarrier "
                                    f"in {limit * 1e3:.0f} ms (rank {members[0]} waited: {why})")


def _why(exc: BaseException, limit: float) -> str:
    return f"nothing within {limit:g}s" if isinstance(exc, CommTimeout) else str(exc)
