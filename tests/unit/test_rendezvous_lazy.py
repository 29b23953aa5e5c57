"""The rendezvous that does not read every hello on every rank (issue 32.5), in one process:
ranks are threads with their own store clients on one real store (loopback)."""
from __future__ import annotations

import threading

import pytest

from commrt.runtime import rendezvous
from commrt.runtime.errors import RendezvousError
from commrt.topology import nodes


def _meet(client_of, infos: list[dict], timeout_s: float = 10, needs_all=lambda table: False) -> list:
    """Every rank's ``meet`` (or the error it raised), index = rank."""
    out: list = [None] * len(infos)

    def rank(r: int, client) -> None:
        try:
            out[r] = rendezvous.meet(client, r, len(infos), infos[r], timeout_s, "t/", needs_all)
        except RendezvousError as exc:
            out[r] = exc
    clients = [client_of() for _ in infos]
    threads = [threading.Thread(target=rank, args=(r, clients[r])) for r in range(len(infos))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def _infos(k: int, m: int, **rank_changes) -> list[dict]:
    infos = [{"config": "d", "backend": "zmq", "addr": [f"tcp://h:{r}"], "node": [r // m, r % m, m]}
             for r in range(k * m)]
    for r, change in rank_changes.items():
        infos[int(r[1:])].update(change)
    return infos


@pytest.mark.parametrize("k,m", [(1, 1), (3, 2), (4, 4)])
def test_node_sizes_round_trip(k, m):
    t = nodes.from_hints([(r // m, r % m, m) for r in range(k * m)])
    assert nodes.node_sizes(t) == [[m, k]] and nodes.from_sizes(nodes.node_sizes(t)) == t
    uneven = nodes.from_keys(list("aabbbcdd"))
    assert nodes.node_sizes(uneven) == [[2, 1], [3, 1], [1, 1], [2, 1]]
    assert nodes.from_sizes(nodes.node_sizes(uneven)).node_of == uneven.node_of
    with pytest.raises(RendezvousError, match="malformed"):
        nodes.from_sizes([[0, 2]])


def test_with_node_hints_only_rank_0_reads_every_hello(store):
    met = _meet(store, _infos(2, 4))
    assert met[0].table is not None and met[0].read[0] == 8 and met[0].nodes == [[4, 2]]
    for m in met[1:]:  # rank 0's hello only (it checked itself against it)
        assert m.table is None and m.nodes == [[4, 2]] and m.read[0] == 1 and m.known[0]["rank"] == 0
    book = rendezvous.Hellos(store(), 5, 8, "t/", 5, met[5])
    assert book.lazy and book.stats()["hellos_read"] == 1
    assert {p: h["addr"] for p, h in book.get([4, 6, 0], "init").items()} == \
        {4: ["tcp://h:4"], 6: ["tcp://h:6"], 0: ["tcp://h:0"]}
    book.get([6, 2], "all_reduce")
    assert book.stats()["hellos_read"] == 4  # 0 at meet, then 4 and 6, then 2: each once
    assert book.get([3], "x", lost=0) == {}  # rank 0 serves the store: no request to a dead one
    assert book.stats()["hellos_read"] == 4
    via = rendezvous.Hellos(store(), 5, 8, "t/", 5, met[5], proxy_rank=4)  # node 1's store proxy
    assert via.get([3], "x", lost=4) == {} and via.get([3], "x", lost=0) == {}  # either cuts it off
    assert via.stats()["hellos_read"] == 1 and via.get([3], "x", lost=7)[3]["rank"] == 3


def test_without_node_hints_every_rank_reads_every_hello(store):
    infos = [{**i, "node": None, "where": "x"} for i in _infos(1, 3)]
    met = _meet(store, infos)
    assert all(m.nodes is None and [h["addr"] for h in m.table] == [i["addr"] for i in infos] for m in met)


def test_a_shared_memory_world_reads_every_hello(store):
    met = _meet(store, _infos(1, 3), needs_all=lambda t: True)
    assert all(m.nodes is None and len(m.table) == 3 for m in met)


def test_a_rank_unlike_rank_0_fails_every_rank_with_one_message(store):
    met = _meet(store, _infos(2, 4, r5={"config": "other"}))
    assert all(isinstance(m, RendezvousError) for m in met), met
    assert {str(m) for m in met} == {str(met[5])}
    assert str(met[5]).startswith("rank 5 (") and "has config digest 'other', rank 0 has 'd'" in str(met[5])


def test_a_bad_layout_found_by_rank_0_fails_every_rank_alike(store):
    met = _meet(store, _infos(2, 2, r2={"node": [0, 2, 2]}))
    assert all(isinstance(m, RendezvousError) for m in met), met
    assert len({str(m) for m in met}) == 1 and "rank 2 says GROUP_RANK=0 LOCAL_RANK=2" in str(met[0])


def test_a_hello_missing_from_the_store_names_the_peer_and_op(store):
    met = _meet(store, _infos(1, 2))
    book = rendezvous.Hellos(store(), 1, 3, "t/", 0.2, met[1])  # a world of 3: rank 2 never was
    with pytest.raises(RendezvousError, match=r"rank 1: cannot read the address of peer rank 2 for all_reduce"):
        book.get([2], "all_reduce")
