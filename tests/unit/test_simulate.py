"""The schedule simulator (issue 32.4) against hand-computed times, and its link accounting
against the bytes the schedules say they send (counted here, independently of the replay)."""
import dataclasses
import queue
import threading

import pytest
import torch

from commrt.collectives import ops
from commrt.collectives.algorithms import chunk_bounds
from commrt.collectives.reduce_ops import ReduceOp
from commrt.collectives.schedules import ALGORITHMS, schedule
from commrt.collectives.selection import table_from
from commrt.plan.network import Network
from commrt.plan.simulate import simulate, truncated
from commrt.plan.simulate_fit import _MemCtx

S = 1 << 20


def test_two_ranks_take_latency_plus_bytes_over_bandwidth():
    net = Network(world=2, per_node=2, intra_latency=3e-6, intra_bw=50e9)
    assert simulate(net, "all_reduce", "recursive_doubling", S).seconds == pytest.approx(3e-6 + S / 50e9, rel=1e-12)
    net = Network(world=2, per_node=1, intra_latency=1e-6, nic_latency=4e-6, intra_bw=100e9, nic_bw=10e9)
    assert simulate(net, "broadcast", "binomial", S).seconds == pytest.approx(5e-6 + S / 10e9, rel=1e-12)


def test_messages_sharing_a_nic_are_serialised():
    # 2 nodes x 2 ranks: an exchange inside the node, then both ranks of a node cross one NIC
    net = Network(world=4, per_node=2, intra_latency=1e-6, nic_latency=4e-6, intra_bw=100e9, nic_bw=10e9)
    want = (1e-6 + S / 100e9) + (5e-6 + 2 * S / 10e9)
    assert simulate(net, "all_reduce", "recursive_doubling", S).seconds == pytest.approx(want, rel=1e-12)


def test_ring_and_recursive_doubling_cross_over():
    net = Network(world=16, per_node=8)
    small = {a: simulate(net, "all_reduce", a, 4096).seconds for a in ("ring", "recursive_doubling")}
    large = {a: simulate(net, "all_reduce", a, 16 << 20).seconds for a in ("ring", "recursive_doubling")}
    assert small["recursive_doubling"] < small["ring"] / 3 and large["ring"] < large["recursive_doubling"] / 3


def _bytes_sent(sched, numel, itemsize=4):
    bounds = chunk_bounds(numel, sched.parts)
    size = lambda rng: sum(bounds[i % sched.parts][1] - bounds[i % sched.parts][0] for i in range(*rng))  # noqa: E731
    total = cross = 0
    for r, steps in enumerate(sched.ranks):
        for s in steps:
            if s.send_to is not None:
                total += size(s.send) * itemsize
                cross += size(s.send) * itemsize * (r // 4 != s.send_to // 4)
    return total, cross


@pytest.mark.parametrize("collective,algo", [(c, a) for c in ALGORITHMS for a in ALGORITHMS[c]])
@pytest.mark.parametrize("n", [1, 6, 13])
def test_link_loads_add_up_to_the_bytes_the_schedule_sends(collective, algo, n):
    net = Network(world=n, per_node=4, nodes_per_leaf=2)
    nbytes = 4 * 1001
    res = simulate(net, collective, algo, nbytes, piece_bytes=1024)
    total, cross = _bytes_sent(schedule(collective, algo, n, 0, 4), nbytes // 4)
    by_kind = {}
    for (kind, _), b in res.link_bytes.items():
        by_kind[kind] = by_kind.get(kind, 0) + b
    assert res.bytes_sent == total == by_kind.get("out", 0) == by_kind.get("in", 0)
    assert by_kind.get("nic_up", 0) == by_kind.get("nic_down", 0) == cross
    assert by_kind.get("leaf_up", 0) <= cross


def test_truncated_schedules_are_rank_0_rotated_and_the_extension_matches_a_full_replay():
    full = schedule("all_reduce", "ring", 12)
    cut = truncated("all_reduce", "ring", 12, 3, 2)
    assert cut.ranks == [st[:3] + st[11:14] for st in full.ranks]
    net = Network(world=64, per_node=8)
    for nbytes in (4096, 16 << 20):
        whole = simulate(net, "all_reduce", "ring", nbytes)
        part = simulate(net, "all_reduce", "ring", nbytes, max_rank_steps=1000)
        assert whole.replayed == 1 and part.replayed < 0.2
        assert part.seconds == pytest.approx(whole.seconds, rel=0.1)
        assert part.bytes_sent == whole.bytes_sent


def test_the_chain_is_cut_in_the_pieces_ops_broadcast_sends():
    # ops.broadcast sends whole pieces of piece_bytes and a short last one (5 MiB: 4 + 1 MiB);
    # the replay cut the buffer in equal parts (2.5 + 2.5), so 5 MiB took 7.5 units, less than
    # 4 MiB's 8. Three ranks, no latency: rank 1 forwards piece i while piece i+1 arrives
    net = Network(world=3, per_node=3, intra_latency=0.0, intra_bw=1e9)
    unit = S / 1e9
    four, five = (simulate(net, "broadcast", "chain", m * S, piece_bytes=4 * S) for m in (4, 5))
    assert four.seconds == pytest.approx(8 * unit, rel=1e-9)
    assert five.seconds == pytest.approx((4 + 4 + 1) * unit, rel=1e-9)
    assert five.messages == 4 and five.bytes_sent == 2 * 5 * S


@pytest.mark.parametrize("collective,algo", [("all_to_all", "pairwise"), ("all_reduce", "ring")])
def test_a_schedule_the_extension_would_replay_more_of_is_replayed_whole(collective, algo):
    # 30 ranks over 800 rank-steps: k = 13 of 29 steps per phase, the k and 2k replays 3k = 39
    # steps: more than the whole, yet extrapolated ("replayed" 1.34, and the table's note about
    # results replayed in part, which looks for < 1, silent)
    net = Network(world=30, per_node=4, nodes_per_leaf=2)
    whole = simulate(net, collective, algo, 1 << 20, max_rank_steps=10**6)
    cut = simulate(net, collective, algo, 1 << 20, max_rank_steps=800 * (2 if algo == "ring" else 1))
    assert cut.replayed == 1.0 and cut.seconds == whole.seconds


def test_pairwise_all_to_all_queues_every_send_before_its_receives_as_the_executor_does():
    # scheduled.run(sends_first=True): ops.all_to_all queues its n-1 sends at once, then takes
    # the receives: one latency, not one per step. The replay ran the steps as blocking
    # sendrecvs: 7 latencies (14 us) at 8 ranks for 4 B per peer
    net = Network(world=8, per_node=8, intra_latency=2e-6, intra_bw=100e9)
    res = simulate(net, "all_to_all", "pairwise", 8 * 4)
    assert res.seconds == pytest.approx(2e-6 + 7 * 4 / 100e9, rel=1e-9)
    assert res.messages == 8 * 7 and res.bytes_sent == 8 * 7 * 4
    # the bytes of the n-1 messages still leave one after another through the rank's port
    big = simulate(net, "all_to_all", "pairwise", 8 * S)
    assert big.seconds == pytest.approx(2e-6 + 7 * S / 100e9, rel=1e-9)


def _executor_messages(collective: str, algo: str, n: int, numel: int, piece_elems: int) -> int:
    """Messages ops.py sends running ``algo`` over in-memory queues (simulate_fit's context)."""
    wires = {(a, b): queue.Queue() for a in range(n) for b in range(n)}
    table, sent = table_from({collective: algo}), [0] * n

    def rank(r):
        ctx = _MemCtx(r, n, table, wires)
        ctx.piece_elems, send = piece_elems, ctx.send
        ctx.send = lambda dst, data=None: (sent.__setitem__(r, sent[r] + 1), send(dst, data))
        t = torch.ones(numel)
        if collective == "all_reduce":
            ops.all_reduce(ctx, t, ReduceOp.SUM)
        else:
            ops.all_gather(ctx, t, t[r * (numel // n):(r + 1) * (numel // n)].clone())
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    return sum(sent)


@pytest.mark.parametrize("collective,algo,n,numel", [("all_reduce", "recursive_doubling", 4, 1000),
                                                     ("all_reduce", "rabenseifner", 6, 3000),
                                                     ("all_gather", "bruck", 5, 5 * 100)])
def test_messages_are_the_pieces_the_executor_sends(collective, algo, n, numel):
    # scheduled.run cuts each step's range into its contiguous spans (Bruck's wrap: two) and
    # those into pieces of piece_bytes; the replay counted one message a step (and charged the
    # CPU term's per-message cost once): 8 where the executor sent 32
    net = Network(world=n, per_node=n)
    res, sent = simulate(net, collective, algo, numel * 4, piece_bytes=256 * 4), _executor_messages(
        collective, algo, n, numel, 256)
    assert res.messages == sent
    # 1 s of CPU a message on each side: at least a rank's mean messages, twice
    cpu = simulate(dataclasses.replace(net, cpu_msg=1.0), collective, algo, numel * 4, piece_bytes=256 * 4)
    assert cpu.seconds >= 2 * sent / n
