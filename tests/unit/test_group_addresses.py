"""A zmq group's address book (runtime/groups.py, issue 32.5) in one process: members are threads
with their own store clients on one real store (loopback)."""
from __future__ import annotations

import threading
import time

import pytest

from commrt.runtime import groups, rendezvous
from commrt.runtime.errors import RendezvousError
from commrt.topology import nodes

MEMBERS = (1, 3, 6)


def _book(client, me: int, tally: groups.Tally, timeout_s: float = 10.0, gid: int = 4):
    return groups.GroupAddresses(client, "t/", gid, MEMBERS, me, timeout_s, tally)


def test_a_partner_is_read_once_when_first_needed_and_a_late_one_is_waited_for(store):
    tally = groups.Tally()
    mine = _book(store(), 3, tally)
    mine.publish(["tcp://h:3", "tcp://h:30", "shm:-"])
    _book(store(), 1, groups.Tally()).publish(["tcp://h:1", "tcp://h:10", "shm:-"])
    assert tally.stats() == {"group_addresses_read": 0, "group_address_bytes": 0, "group_addresses_published": 1}
    late = threading.Timer(2.5 * groups.READ_SLICE_S, lambda: _book(store(), 6, groups.Tally()).publish(["tcp://h:6"]))
    late.start()
    try:  # group rank 2 (world rank 6) publishes a few read slices later: waited for, not an error
        got = mine.get([0, 2], "all_reduce")
    finally:
        late.join()
    assert got == {0: ["tcp://h:1", "tcp://h:10", "shm:-"], 2: ["tcp://h:6"]}
    assert mine.every("new_group") == [["tcp://h:1", "tcp://h:10", "shm:-"], ["tcp://h:3", "tcp://h:30", "shm:-"],
                                       ["tcp://h:6"]]
    assert tally.stats()["group_addresses_read"] == 2  # each partner once, ours never
    assert tally.stats()["group_address_bytes"] > 0


def test_threads_resolving_together_read_each_entry_once(store):
    for r in MEMBERS:
        _book(store(), r, groups.Tally()).publish([f"tcp://h:{r}"])
    tally = groups.Tally()
    book = _book(store(), 1, tally)
    out = []
    threads = [threading.Thread(target=lambda: out.append(book.get([1, 2], "op"))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert out == [{1: ["tcp://h:3"], 2: ["tcp://h:6"]}] * 4 and tally.stats()["group_addresses_read"] == 2


def test_a_member_that_never_publishes_is_an_error_naming_it_and_the_op(store):
    book = _book(store(), 3, groups.Tally(), timeout_s=0.5, gid=9)
    start = time.monotonic()
    with pytest.raises(RendezvousError, match=r"rank 3: group 9 \(ranks 1, 3, 6\): rank 1, 6 published no "
                                              r"address within 0.5s for broadcast"):
        book.get([0, 2], "broadcast")
    assert time.monotonic() - start < 5


def test_a_dead_store_host_gives_only_what_is_known(store):
    class Dead:
        def __getattr__(self, name):
            raise AssertionError(f"the store was asked ({name}) though its host is lost")
    book = groups.GroupAddresses(Dead(), "t/", 2, (0, 4), 4, 5.0, groups.Tally(), store_rank=0)
    book._known[1] = ["tcp://h:4"]
    assert book.get([0, 1], "abort notice", lost=0) == {1: ["tcp://h:4"]}


def _hellos(lazy: bool, entries: list[str], rank: int = 0) -> rendezvous.Hellos:
    """Rank ``rank``'s world hellos of 8 ranks (2 nodes of 4): every hello, or its node's only;
    a store that fails the test if asked."""
    table = [{"rank": r, "addr": ["tcp://a", "tcp://b", entries[r]]} for r in range(8)]
    node = range(rank // 4 * 4, rank // 4 * 4 + 4)
    met = rendezvous.Met(table[rank], [[4, 2]] if lazy else None, None if lazy else table,
                         known={r: table[r] for r in node})

    class NoStore:
        def __getattr__(self, name):
            raise AssertionError(f"deciding read the store ({name})")
    return rendezvous.Hellos(NoStore(), rank, 8, "t/", 5.0, met)


def test_members_read_every_address_at_creation_only_where_they_may_share_memory():
    layout = nodes.from_sizes([[4, 2]])
    node_key = [f"shm:n{r // 4}:s{r}" for r in range(8)]
    one_host = [f"shm:n0:s{r}" for r in range(8)]
    every = groups.every_address_at_creation
    assert every(_hellos(True, node_key), layout, (0, 2, 3))  # one node, each with a segment
    assert not every(_hellos(True, node_key), layout, (0, 5))  # two nodes: not even asked
    assert not every(_hellos(True, node_key), layout, (2,))  # nobody to share with
    assert every(_hellos(False, one_host), layout, (1, 6))  # every hello held, one host
    assert not every(_hellos(False, node_key), layout, (1, 6))
    assert not every(_hellos(False, one_host[:3] + ["shm:-"] + one_host[4:]), layout, (2, 3))  # no segment
    assert every(None, None, (0, 1))  # a world without hellos: every member's, as many as members
