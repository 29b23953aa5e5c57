"""Pure layout logic: torchrun variables or host identities -> nodes; mesh rows; link bytes;
the emulated cluster's plan and argument parsing (no processes, no namespaces)."""
import pytest

from commrt import emulate
from commrt.topology import nodes as topology
from commrt.runtime.errors import ConfigError, RendezvousError
from commrt.topology.mesh import mesh_rows
from commrt.obs.stats import split_by_node
from commrt.transport.wire import COLL, P2P


def hints(k, m):
    return [(r // m, r % m, m) for r in range(k * m)]


@pytest.mark.parametrize("k,m", [(1, 1), (1, 4), (2, 2), (3, 2), (4, 1)])
def test_torchrun_variables_give_contiguous_nodes(k, m):
    t = topology.from_hints(hints(k, m))
    assert t.num_nodes == k and t.per_node() == m and t.source == "env"
    for r in range(k * m):
        assert (t.node_rank(r), t.local_rank(r), t.local_world_size(r)) == (r // m, r % m, m)
        assert t.ranks_on(r // m) == list(range(r // m * m, r // m * m + m))


@pytest.mark.parametrize("bad", [
    [(0, 0, 2), (1, 0, 2), (0, 1, 2), (1, 1, 2)],  # interleaved nodes
    [(0, 0, 2), (0, 1, 2), (0, 0, 2), (1, 1, 2)],  # a node numbered twice
    [(0, 0, 2), (0, 1, 2), (1, 0, 2)],  # the last node is short
    [(0, 0, 2), (0, 0, 2)],  # duplicate local rank
    [(1, 0, 1)],  # nodes must start at 0
    [(0, 0, 2), (0, 1, 3), (0, 2, 3)],  # disagreeing LOCAL_WORLD_SIZE
])
def test_inconsistent_or_non_contiguous_variables_are_rendezvous_errors(bad):
    with pytest.raises(RendezvousError, match="contiguous|LOCAL_WORLD_SIZE"):
        topology.from_hints(bad)


def test_hosts_group_ranks_and_must_be_contiguous():
    t = topology.from_keys(["a", "a", "b", "b", "b", "c"])
    assert t.node_of == (0, 0, 1, 1, 1, 2) and t.per_node() == 0 and t.local_rank(4) == 2
    with pytest.raises(RendezvousError, match="rank 2 shares a with rank"):
        topology.from_keys(["a", "b", "a"])


def test_hellos_use_hints_only_when_every_rank_has_them():
    same_host = [{"host": "h", "where": "198.18.0.1", "node": None}, {"host": "h", "where": "198.18.0.2",
                                                                        "node": [0, 1, 2]}]
    assert topology.from_hellos(same_host).node_of == (0, 1)  # namespaces: same name, other address
    both = [{"host": "h", "where": "x", "node": [0, 0, 1]}, {"host": "h", "where": "x", "node": [1, 0, 1]}]
    assert topology.from_hellos(both).node_of == (0, 1)


def test_node_hint_reads_all_three_or_none():
    assert topology.node_hint({"GROUP_RANK": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}) == [1, 0, 2]
    assert topology.node_hint({"LOCAL_RANK": "0"}) is None
    with pytest.raises(RendezvousError, match="integers"):
        topology.node_hint({"GROUP_RANK": "x", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"})


def test_mesh_rows_are_row_major():
    assert mesh_rows((2, 3)) == [[[0, 3], [1, 4], [2, 5]], [[0, 1, 2], [3, 4, 5]]]
    assert mesh_rows((4,)) == [[[0, 1, 2, 3]]]


def test_split_by_node_classifies_peers_and_ops():
    sent = {(COLL, 1, "rank1"): 10, (COLL, 1, "rank2"): 5, (COLL, 3, "rank1"): 2, (P2P, 0, "rank3"): 7,
            (COLL, 1, "store"): 99}
    s = split_by_node(sent, [True, True, False, False])
    assert (s["intra_node_bytes"], s["inter_node_bytes"]) == (12, 12)
    assert s["by_op"]["all_reduce"] == {"intra_node_bytes": 10, "inter_node_bytes": 5}
    assert s["by_op"]["p2p"] == {"intra_node_bytes": 0, "inter_node_bytes": 7}


@pytest.mark.parametrize("spec,rate,delay", [("1gbit", "1gbit", None), ("100mbit,0.2ms", "100mbit", "0.2ms")])
def test_parse_shape(spec, rate, delay):
    shape = emulate.parse_shape(spec)
    assert (shape.rate, shape.delay) == (rate, delay)


@pytest.mark.parametrize("spec", ["", "fast", "1gbit,soon", "1gbit,1ms,2", "-1gbit", "0gbit"])
def test_parse_shape_refuses(spec):
    with pytest.raises(ConfigError, match="emulate-network"):
        emulate.parse_shape(spec)


def test_plan_names_everything_per_run_and_shapes_both_directions():
    names, cmds = emulate.plan("123-abc", 2, emulate.parse_shape("1gbit"))
    assert names == ["commrt-emu-123-abc-sw", "commrt-emu-123-abc-n0", "commrt-emu-123-abc-n1"]
    tbf = [c for c in cmds if c[0] == "tc" and "tbf" in c]
    assert len(tbf) == 4 and all("1gbit" in c for c in tbf)
    assert {c[2] for c in tbf} == set(names)  # each node's side and the switch's side
    # under each tbf, small TCP packets (ACKs) go to the class served first
    acks = [c for c in cmds if c[0] == "tc" and "filter" in c]
    assert len(acks) == 4 and all(c[-1] == "20:1" and "0xff80" in c for c in acks)
    assert all(c[c.index("parent") + 1] == "1:1" for c in cmds if "htb" in c and "qdisc" in c)
    # each node's TCP congestion control is set, not the host's (BBR idled the links)
    cc = [c[3] for c in cmds if c[:3] == ["ip", "netns", "exec"] and "tcp_congestion_control" in c[-1]]
    assert cc == names[1:] and all(emulate.CONGESTION_CONTROL in c[-1] for c in cmds if c[:3] == ["ip", "netns", "exec"])
    _, cmds = emulate.plan("1-a", 1, emulate.parse_shape("1gbit,2ms"))
    assert sum("netem" in c for c in cmds) == 2
    assert all(c[c.index("parent") + 1] == "10:1" for c in cmds if "htb" in c and "qdisc" in c)
    assert all(a.startswith("198.18.") for c in cmds for a in c if a[:1].isdigit() and "/" in a)
