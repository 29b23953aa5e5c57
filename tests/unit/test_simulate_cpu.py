"""The simulator's CPU term (plan/network.py cpu_*, cores; plan/simulate.py _Cores) and its fit
(plan/fit_cpu.py): hand-computed replays of a message's CPU on both sides, ranks beyond the cores
taking turns, and a fit that recovers a model it generated. Pure: no processes."""
import numpy as np
import pytest

from commrt.plan import fit_cpu as fc
from commrt.plan.network import Network
from commrt.plan.simulate import simulate

MS = 1e-3


def _cpu_net(world, cores=0, **kw):
    base = dict(per_node=world, intra_latency=0.0, intra_bw=1e30, cpu_msg=MS)
    return Network(world=world, cores=cores, **{**base, **kw})


def test_the_cpu_term_is_off_by_default():
    net = Network(world=4, per_node=4)
    assert not net.cpu_modelled
    got = simulate(net, "all_reduce", "recursive_doubling", 4096).seconds
    assert got == pytest.approx(2 * (2e-6 + 4096 / 100e9))  # two steps of latency + bytes, no CPU


def test_a_message_costs_its_sender_and_its_receiver():
    # send's CPU, then the receive's: 1 ms + 4096 B x 1 ns each side
    got = simulate(_cpu_net(2, cpu_byte=1e-9), "all_reduce", "recursive_doubling", 4096).seconds
    assert got == pytest.approx(2 * (MS + 4096e-9))


def test_ranks_beyond_the_cores_take_turns():
    # one core for two ranks: both sends (0-1, 1-2 ms), then both receives (2-3, 3-4 ms)
    assert simulate(_cpu_net(2, cores=1), "all_reduce", "recursive_doubling", 4096).seconds == pytest.approx(4 * MS)
    assert simulate(_cpu_net(2, cores=2), "all_reduce", "recursive_doubling", 4096).seconds == pytest.approx(2 * MS)
    # 8 ranks, 3 steps of 2 ms each: 6 ms on a core each, 24 ms of work for 2 cores
    own = simulate(_cpu_net(8), "all_reduce", "recursive_doubling", 4096).seconds
    shared = simulate(_cpu_net(8, cores=2), "all_reduce", "recursive_doubling", 4096).seconds
    assert own == pytest.approx(6 * MS) and shared == pytest.approx(24 * MS)


def test_an_emulated_cluster_shares_one_hosts_cores_across_its_nodes():
    kw = dict(per_node=2, nic_latency=0.0, nic_bw=1e30, cores=2)
    one_host = simulate(_cpu_net(8, ranks_per_host=8, **kw), "all_reduce", "recursive_doubling", 4096).seconds
    per_node = simulate(_cpu_net(8, **kw), "all_reduce", "recursive_doubling", 4096).seconds
    assert per_node == pytest.approx(6 * MS) and one_host == pytest.approx(24 * MS)


def test_a_reduction_takes_a_core_too():
    net = _cpu_net(2, cores=1, cpu_msg=0.0, reduce_bw=4096 / MS)  # 1 ms per 4 KiB reduced
    assert simulate(net, "all_reduce", "recursive_doubling", 4096).seconds == pytest.approx(2 * MS)
    assert simulate(net, "broadcast", "binomial", 4096).seconds == pytest.approx(0.0)  # copies, no reduction


def test_nelder_mead_finds_a_minimum():
    x = fc.nelder_mead(lambda v: float(np.sum((v - np.array([1.0, -2.0])) ** 2)), [0.0, 0.0], iters=300, tol=1e-12)
    assert x == pytest.approx([1.0, -2.0], abs=1e-4)


def test_the_fit_recovers_a_model_it_generated_and_the_emulated_link_is_not_fitted():
    true = fc.Params(5e-6, 2e9, 40e-6, 0.3e-9, 3e9, 2)
    cases = [fc.Case("all_reduce", a, n, s) for n in (2, 8) for s in (4096, 1 << 20)
             for a in ("recursive_doubling", "ring", "rabenseifner")]
    seconds = [fc.predict(true, c, back_to_back=False) for c in cases]
    got = fc.fit(cases, seconds, cores=2, rounds=2, back_to_back=False)
    assert fc.error(got, cases, seconds, back_to_back=False) < 1e-3  # rms log error < 3%
    emu = fc.Case("all_reduce", "ring", 8, 1 << 20, per_node=2, nic_bps=100e6)
    # the ring at 4 x 2 crosses each node link with 2 x 7/8 of the buffer, at the shaped payload rate
    assert fc.predict(got, emu) >= 2 * 7 / 8 * (1 << 20) / (100e6 / 8 * fc.WIRE_PAYLOAD)
    with pytest.raises(ValueError, match="rate"):
        fc.network(got, 8, per_node=2)


def _bucket_net(burst):
    return Network(world=2, per_node=1, intra_latency=0.0, intra_bw=1e30, nic_latency=0.0, nic_bw=1e6,
                   nic_burst=burst)


def test_a_node_links_token_bucket_lends_what_idling_saved():
    # one message of 96 kB over a 1 MB/s link: 96 ms without a bucket, (96 - 64) ms with 64 kB saved
    assert simulate(_bucket_net(0), "broadcast", "binomial", 96_000).seconds == pytest.approx(0.096)
    assert simulate(_bucket_net(64_000), "broadcast", "binomial", 96_000).seconds == pytest.approx(0.032)
    assert simulate(_bucket_net(64_000), "broadcast", "binomial", 32_000).seconds == pytest.approx(0.0, abs=1e-12)


def test_back_to_back_ops_drain_the_bucket():
    net = _bucket_net(64_000)
    one = simulate(net, "broadcast", "binomial", 32_000).seconds
    four = simulate(net, "broadcast", "binomial", 32_000, repeat=4).seconds
    # the bucket pays for the first two ops; from then on each op waits for its 32 ms of tokens
    assert one == pytest.approx(0.0, abs=1e-12) and four == pytest.approx(0.064)
    # the emulated cluster's bucket is emulate.py's: 10 ms of the rate, at least 64 KiB
    p = fc.Params(0.0, 1e30, 0.0, 0.0, 1e30, 0)
    assert fc.network(p, 4, 2, 100e6).nic_burst == pytest.approx(125_000 * fc.WIRE_PAYLOAD)
    assert fc.network(p, 4, 2, 10e6).nic_burst == pytest.approx(65536 * fc.WIRE_PAYLOAD)
    emu = fc.Case("broadcast", "binomial", 2, 60_000, per_node=1, nic_bps=8e6 / fc.WIRE_PAYLOAD)  # 1 MB/s of payload
    assert fc.predict(p, emu, back_to_back=False) == pytest.approx(0.0, abs=1e-12)
    assert fc.predict(p, emu) == pytest.approx(0.060)  # a loop of them: each at the rate
