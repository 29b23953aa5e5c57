"""The simulator's two link disciplines (issue 32.4): first come, first served (plan/simulate.py
``_transmit``) against max-min fair sharing (plan/links.py ``Fluid``), on hand-computed flows and
one hand-computed replay where they differ. Pure: no processes."""
import dataclasses
from collections import defaultdict

import pytest

from commrt.plan import fit_cpu
from commrt.plan.links import Fluid
from commrt.plan.network import Network
from commrt.plan.simulate import _transmit, simulate

S = 1 << 20
BW = 1e9
UP0, UP1, DOWN1 = ("nic_up", 0), ("nic_up", 1), ("nic_down", 1)


def _net(**kw):
    return Network(world=4, per_node=1, intra_latency=0.0, nic_latency=0.0, intra_bw=1e15, nic_bw=BW, **kw)


def _ends(fluid):
    """Every flow's end time, letting the events happen in order."""
    out = {}
    while fluid.next_time() != float("inf"):
        when, ended = fluid.step()
        out.update({fid: when for fid in ended})
    return out


def test_two_equal_messages_on_one_link_fcfs_one_then_the_other_fair_both_at_twice():
    free = defaultdict(float)  # as replay keeps it: a link never used is free at 0
    first = _transmit(_net(), free, (UP0,), 0.0, S, BW)
    second = _transmit(_net(), free, (UP0,), 0.0, S, BW)
    assert (first, second) == pytest.approx((S / BW, 2 * S / BW))
    fluid = Fluid(_net(sharing="fair"))
    fluid.start(0.0, "a", (UP0,), S)
    fluid.start(0.0, "b", (UP0,), S)
    assert _ends(fluid) == pytest.approx({"a": 2 * S / BW, "b": 2 * S / BW})


def test_a_flow_that_joins_later_slows_the_first_from_then_on():
    # a alone for S/2 of its bytes, then both at half: a's last S/2 takes S/BW; b ends alone
    fluid = Fluid(_net(sharing="fair"))
    fluid.start(0.0, "a", (UP0,), S)
    assert fluid.next_time() == pytest.approx(S / BW)
    fluid.start(S / (2 * BW), "b", (UP0,), S)
    assert _ends(fluid) == pytest.approx({"a": 1.5 * S / BW, "b": 2 * S / BW})


def test_a_flow_goes_at_its_bottlenecks_share_and_the_others_take_what_it_leaves():
    # x crosses UP0 and DOWN1; y shares UP0 only; z1, z2 share DOWN1: DOWN1 gives x, z1, z2 a
    # third each, so y gets the two thirds of UP0 that x leaves (equal shares would give y half)
    fluid = Fluid(_net(sharing="fair"))
    for fid, links in (("x", (UP0, DOWN1)), ("y", (UP0,)), ("z1", (DOWN1, UP1)), ("z2", (DOWN1,))):
        fluid.start(0.0, fid, links, S)
    ends = _ends(fluid)
    assert ends["y"] == pytest.approx(1.5 * S / BW)
    assert ends["x"] == ends["z1"] == ends["z2"] == pytest.approx(3 * S / BW)


def test_a_rested_token_bucket_sends_its_bytes_at_the_ports_speed_then_the_rate():
    burst = 256 << 10
    fcfs = _transmit(_net(nic_burst=burst), defaultdict(float), (UP0,), 0.0, S, BW)
    fluid = Fluid(_net(nic_burst=burst, sharing="fair"))
    fluid.start(0.0, "a", (UP0,), S)
    assert _ends(fluid)["a"] == pytest.approx(fcfs, rel=1e-6)
    assert fcfs == pytest.approx((S - burst) / BW, rel=1e-6)


def test_a_replay_where_the_disciplines_differ():
    # 3 ranks, one per node, recursive doubling: ranks 0 and 2 both send S to rank 1 at once
    # (the fold and the exchange), sharing nic_down(1); then 1 <-> 2, then 1 -> 0.
    # FCFS: 0's lands at 1, 2's at 2; 1 sends to 2 over 1..2, to 0 over 2..3. Fair: both land at
    # 2; 1 -> 2 over 2..3, 1 -> 0 over 3..4 (in units of S / BW).
    net = Network(world=3, per_node=1, intra_latency=0.0, nic_latency=0.0, intra_bw=1e15, nic_bw=BW)
    fcfs = simulate(net, "all_reduce", "recursive_doubling", S)
    fair = simulate(dataclasses.replace(net, sharing="fair"), "all_reduce", "recursive_doubling", S)
    assert fcfs.seconds == pytest.approx(3 * S / BW, rel=1e-6)
    assert fair.seconds == pytest.approx(4 * S / BW, rel=1e-6)
    assert fair.link_bytes == fcfs.link_bytes and fair.messages == fcfs.messages == 4


def test_fair_sharing_replays_every_schedule_to_the_end_with_the_same_bytes():
    # the event loop interleaving the links' ends with the ranks' steps never deadlocks or drops
    # a message, with the CPU term's shared cores and a token bucket on
    kw = dict(world=6, per_node=2, cpu_msg=1e-5, cores=2, nic_burst=64 << 10)
    for collective, algo in (("all_reduce", "ring"), ("all_reduce", "rabenseifner"), ("all_gather", "bruck"),
                             ("all_to_all", "pairwise"), ("broadcast", "binomial")):
        fcfs = simulate(Network(**kw), collective, algo, 4 * 1001, repeat=2)
        fair = simulate(Network(**kw, sharing="fair"), collective, algo, 4 * 1001, repeat=2)
        assert fair.link_bytes == pytest.approx(fcfs.link_bytes) and fair.messages == fcfs.messages
        assert fair.seconds > 0


def test_an_unknown_discipline_is_refused():
    with pytest.raises(ValueError, match="sharing"):
        Network(world=2, sharing="lifo")


def test_a_leafs_uplink_carries_its_nodes_flows_at_once_only_when_shared():
    # 2 leaves of 2 nodes, one rank each: doubling's second step sends 0 -> 2 and 1 -> 3 over
    # leaf 0's uplink (2 NICs' worth). Fair: both at NIC rate, 2 S/BW in all. First come, first
    # served takes the whole uplink for one message at the path's NIC rate: 3 S/BW (why the
    # fat-tree predictions need "fair").
    net = Network(world=4, per_node=1, nodes_per_leaf=2, intra_latency=0.0, nic_latency=0.0, spine_latency=0.0,
                  intra_bw=1e15, nic_bw=BW)
    assert simulate(net, "all_reduce", "recursive_doubling", S).seconds == pytest.approx(3 * S / BW)
    fair = simulate(dataclasses.replace(net, sharing="fair"), "all_reduce", "recursive_doubling", S)
    assert fair.seconds == pytest.approx(2 * S / BW)


def test_the_fit_builds_its_networks_with_the_discipline_it_was_given():
    p = fit_cpu.Params(1e-6, 1e9, 1e-5, 0.0, 1e9, 2, "fair")
    assert fit_cpu.network(p, 8, 2, 100e6).sharing == "fair" and fit_cpu.network(p, 4).sharing == "fair"
    assert fit_cpu.network(p._replace(sharing="fcfs"), 8, 2, 100e6).sharing == "fcfs"
