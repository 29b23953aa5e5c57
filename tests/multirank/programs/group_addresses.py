"""Sub-groups on a zmq world learn their members' addresses through the store (issue 32.5):
a non-member reads and sends nothing, a member reads the entries of the partners it dials (all of
them at creation where the members share memory). numpy buffers only; 8 ranks.

    groups   several groups (overlapping, unsorted, the whole world, one of one rank), a
             collective on each checked against the single-process arithmetic, read and sent
             counts checked at each step; prints GROUPS lines
    late     the same, then rank 0 leaves at once while rank 3 first dials rank 6 in their
             group a second later: its address must still be readable (rank 0 keeps its store)

``every-hello`` as a second argument drops the node variables: the world reads every hello.
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

import commrt
from commrt.runtime.group import NON_GROUP_MEMBER

RANK = int(os.environ.get("RANK", -1))  # -1: imported by the test for GROUPS
GROUPS = [[1, 6], [4, 5, 6, 7], [6, 2, 3], [7, 6, 5, 4, 3, 2, 1, 0], [3], [0, 2, 4, 6]]  # of 8 ranks


def _reads() -> tuple[int, int]:
    """(group addresses read, published) so far; 0 where comm_stats does not count them."""
    got = commrt.comm_stats()["rendezvous"]
    return got.get("group_addresses_read", 0), got.get("group_addresses_published", 0)


def _sent() -> tuple[int, int]:
    """Messages and bytes this rank sent on any socket (peers, the store) so far."""
    snap = commrt.distributed._rt().transport.counters.snapshot()
    return sum(c["sent_msgs"] for c in snap.values()), sum(c["sent_bytes"] for c in snap.values())


def _dialled(group) -> set[int]:
    backend = group.backend
    return set(backend._coll._out) | set(backend._p2p_ep._out)  # group ranks with a connection


def _create(ranks: list[int]):
    """new_group, checking what it cost this rank."""
    reads0, sent0 = _reads(), _sent()
    g = commrt.new_group(ranks)
    reads, sent = _reads(), _sent()
    if RANK not in ranks:
        assert g is NON_GROUP_MEMBER, g
        assert sent == sent0, f"rank {RANK}: non-member of {ranks} sent {sent[0] - sent0[0]} messages, " \
                              f"{sent[1] - sent0[1]} bytes creating it"
        assert reads == reads0, f"rank {RANK}: non-member of {ranks} read {reads[0] - reads0[0]} addresses"
        return None, 0
    at_once = g.backend._shm is not None  # members sharing memory read every entry at creation
    partners = len(ranks) - 1
    assert reads[1] - reads0[1] == (1 if partners else 0), f"rank {RANK}: published {reads[1] - reads0[1]}"
    assert reads[0] - reads0[0] == (partners if at_once else 0), \
        f"rank {RANK}: read {reads[0] - reads0[0]} addresses creating {ranks} (shared memory {at_once})"
    return g, reads[0] - reads0[0]


def _check(g, ranks: list[int], at_creation: int) -> int:
    """Collectives on ``g`` against the arithmetic; return the addresses this member read for
    ``g``: ``at_creation`` and those of the partners it first dialled now."""
    members, before = sorted(ranks), _reads()[0]
    x = np.arange(512, dtype=np.int64) * (RANK + 1)
    commrt.all_reduce(x, group=g)
    assert np.array_equal(x, np.arange(512, dtype=np.int64) * sum(r + 1 for r in members)), \
        f"rank {RANK}: all_reduce on {ranks}"
    out = np.zeros(3 * len(members), np.int64)
    commrt.all_gather_into_tensor(out, np.full(3, RANK * 10, np.int64), group=g)
    assert out.tolist() == [r * 10 for r in members for _ in range(3)], f"rank {RANK}: all_gather on {ranks}"
    read = at_creation + _reads()[0] - before
    expect = len(members) - 1 if g.backend._shm is not None else len(_dialled(g))
    assert read == expect <= len(members) - 1, \
        f"rank {RANK}: read {read} addresses for {ranks}, dialled {sorted(_dialled(g))}"
    return read


def _every_group() -> None:
    lazy = commrt.comm_stats()["rendezvous"]["lazy"]
    made = [(ranks, *_create(ranks)) for ranks in GROUPS]  # all created before any is used
    read = {tuple(ranks): _check(g, ranks, n) for ranks, g, n in made if g is not None}
    shm = sorted(tuple(r) for r, g, _ in made if g is not None and g.backend._shm is not None)
    print(f"GROUPS rank {RANK} lazy-world {lazy} shm {shm} read {read} total {_reads()[0]} ok", flush=True)


def groups() -> None:
    commrt.init_process_group()
    _every_group()
    commrt.destroy_process_group()


def late() -> None:
    commrt.init_process_group()
    _every_group()
    pair = commrt.new_group([3, 6])
    if RANK == 3:  # its first dial of rank 6 in this group: rank 0 has long reached its shutdown
        time.sleep(1.0)
        commrt.send(np.full(4, 3, np.int64), 6, group=pair)
    elif RANK == 6:
        buf = np.zeros(4, np.int64)
        commrt.recv(buf, 3, group=pair)
        assert buf.tolist() == [3] * 4, buf
        print("LATE rank 6 got rank 3's message", flush=True)
    commrt.destroy_process_group()


if __name__ == "__main__":
    if "every-hello" in sys.argv:  # no node variables: the world reads every hello at init
        for name in ("GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            os.environ.pop(name, None)
    {"groups": groups, "late": late}[sys.argv[1]]()
