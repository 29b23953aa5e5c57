"""commrt estimate's pure model (the measured check is tests/multirank/test_estimate.py)."""
from __future__ import annotations

import json

import pytest

from commrt import cli
from commrt.runtime.errors import ConfigError
from commrt.plan.command import parse_bandwidth
from commrt.plan.estimate import Cluster, Job, estimate

P = 7_000_000_000


@pytest.mark.parametrize("text,value", [("100GB/s", 1e11), ("12.5GB/s", 12.5e9), ("100gbit", 12.5e9), ("5e9", 5e9)])
def test_bandwidths(text, value):
    assert parse_bandwidth(text) == pytest.approx(value)


def test_bad_bandwidth_is_a_config_error():
    with pytest.raises(ConfigError, match="cannot read bandwidth"):
        parse_bandwidth("fast")


@pytest.mark.parametrize("stage,factor", [(0, 2), (1, 3), (2, 2), (3, 3)])
def test_flat_ring_bytes_are_the_textbook_multiples(stage, factor):
    """One node, ring sizes: stage 0 all_reduce 2(n-1)/n S; stage 1 + all_gather; stage 2
    reduce_scatter + all_gather; stage 3 two gathers + reduce_scatter, each (n-1)/n S."""
    n = 8
    est = estimate(Job(params=P, stage=stage, dtype="bf16"), Cluster(nodes=1, per_node=n))
    sent = sum(a + b for k, (a, b) in est.phases.items() if k != "engine checks all_reduce")
    assert sent == pytest.approx(factor * (n - 1) / n * 2 * P, rel=1e-3)
    assert all(b == 0 for _, b in est.phases.values())


def test_memory_per_stage_divides_as_memory_report_does():
    mem = [estimate(Job(params=P, stage=s), Cluster(nodes=1, per_node=8)).memory for s in range(4)]
    assert mem[0] == {"parameters": 4 * P, "gradients": 4 * P, "optimizer_state": 8 * P, "total": 16 * P}
    assert mem[1]["optimizer_state"] == P  # 8 bytes / 8 ranks
    assert mem[2]["gradients"] == P // 2 and mem[3]["parameters"] == P // 2


def test_hybrid_keeps_gathers_in_the_node_and_hpz_the_backward_gather():
    c = Cluster(nodes=4, per_node=8)
    hsdp = estimate(Job(params=P, strategy="HYBRID_SHARD"), c)
    assert hsdp.plan.replicas == 4 and hsdp.phases["forward all_gather"][1] == 0
    assert hsdp.phases["replica all_reduce"][0] == 0 < hsdp.phases["replica all_reduce"][1]
    hpz = estimate(Job(params=P, stage=3, hpz=8), c)
    assert hpz.phases["hpZ secondary all_gather"][1] == 0 and "backward all_gather" not in hpz.phases


def test_quantized_gathers_send_a_quarter_plus_scales():
    c = Cluster(nodes=1, per_node=8)
    exact = estimate(Job(params=P, stage=3), c).phases["forward all_gather"][0]
    q = estimate(Job(params=P, stage=3, quant_weights="int8"), c).phases["forward all_gather"][0]
    assert q == pytest.approx(exact / 4 * (1 + 4 / 256), rel=1e-3)  # 1 byte of 4, one fp32 scale per 256


def test_invalid_layouts_are_refused_like_the_engine():
    with pytest.raises(ConfigError, match="needs stage 3"):
        estimate(Job(params=P, stage=2, hpz=8), Cluster(nodes=4, per_node=8))
    with pytest.raises(ConfigError, match="does not divide"):
        estimate(Job(params=P, stage=3, hpz=3), Cluster(nodes=4, per_node=8))


def test_command_compares_configurations(capsys):
    argv = ["estimate", "--params", "7e9", "--nodes", "4", "--per-node", "8", "--stage", "3", "--dtype", "bf16",
            "--intra-bw", "100GB/s", "--inter-bw", "12.5GB/s", "--compare", "hpz=8,quant-weights=int8"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "hpz=8,quant-weights=int8" in out and "hpZ secondary all_gather" in out and "ms" in out
    assert cli.main([*argv, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [d["config"] for d in doc] == ["base", "hpz=8,quant-weights=int8"]
    assert doc[1]["plan"]["secondary"] == 8 and doc[0]["seconds"]["total"] > 0


def test_compare_names_a_bad_key():
    assert cli.main(["estimate", "--params", "1e9", "--compare", "stages=2"]) == 1


@pytest.mark.parametrize("k,m", [(2, 2), (3, 2), (4, 8)])
def test_hierarchical_bytes_follow_the_two_level_formulas(k, m):
    """collectives/hierarchical.py: the node's link carries 2(K-1)/K of 1/M of an all_reduce,
    (K-1)/(K M) of a reduce_scatter's input; the rest stays in the node. These are the ring's
    formulas at each level, pinned (the table takes Rabenseifner below 32 MiB), and the two levels
    are forced: "auto" predicts flat at 2 x 2, as the runtime's probe finds, since Rabenseifner
    pairs ranks inside the node first and crosses nodes as little as two levels do."""
    from commrt.collectives.selection import table_from
    from commrt.plan import cost
    ring = table_from({"all_reduce": "ring", "all_gather": "ring"})
    net = cost.Net(k, m, hierarchical="always", table=ring)
    n = 1 << 24  # elements: well above small_bytes at every level, a multiple of every M here
    world = cost.group(0, k * m)
    t = cost.Traffic()
    cost.collective(t, "all_reduce", world, n, 4, net)
    assert t.inter == pytest.approx(2 * (k - 1) / k * n * 4 / m)
    assert t.intra == pytest.approx(2 * (m - 1) / m * n * 4)
    t = cost.Traffic()
    cost.collective(t, "reduce_scatter", world, n, 4, net)
    assert (t.intra, t.inter) == pytest.approx(((m - 1) / m * n * 4, (k - 1) / (k * m) * n * 4))
    t = cost.Traffic()
    cost.collective(t, "all_reduce", world, n, 4, cost.Net(k, m, hierarchical="never", table=ring))
    assert t.inter == pytest.approx(2 * (k * m - 1) / (k * m) * n * 4 / m)  # one ring edge in M leaves the node


def test_quantized_collectives_on_the_world_spanning_nodes_take_two_hops():
    """quant/hierarchical.py on 2 nodes x 2 (auto, decided on the fp32 size even in bf16): exact
    fp32 hops inside the node, only the codes across. Stage 3, own = 1024 values per rank:
    qwZ gather: int8 codes of 1024 = 1024 + 4 scales x 4 = 1040 B to the other node, then an fp32
    all_gather of 2 x 2048 values (8192 B sent inside); qgZ reduce_scatter: fp32 reduce_scatter of
    4096 values inside (8192 B), int4 codes of the other node's chunk, 512 + 16 = 528 B, across.
    The flat all_reduce is the ring's, whose crossings make "auto" take two hops (with the table's
    Rabenseifner it stays flat at 2 x 2: test_auto_hierarchy_...)."""
    c = Cluster(nodes=2, per_node=2, small_bytes=4096, algorithms="all_reduce=ring")
    est = estimate(Job(params=4096, stage=3, dtype="bf16", quant_weights="int8", quant_grads="int4",
                       units=(4096,)), c)
    assert est.phases["forward all_gather"] == est.phases["backward all_gather"] == (8192, 1040)
    assert est.phases["gradient reduce_scatter"] == (8192, 528)
    assert est.by_op["all_to_all"] == (0, 528) and est.by_op["reduce_scatter"] == (8192, 0)


def test_quantized_all_reduce_two_hop_pads_to_the_node_and_sub_groups_stay_flat():
    """4097 values on 2 nodes x 2: fp32 reduce_scatter of 2 x 2049 (padded) inside, the flat
    int4 all_reduce of 2049 across (chunks 1025 / 1024: codes 536 / 528 B, padded to 4; the
    all_to_all sends the other's chunk, 532 B on average, the all_gather 536 B), fp32 all_gather
    inside. HYBRID_SHARD's shard group is one node: its quantized reduce_scatter stays flat."""
    from commrt.plan import cost
    net = cost.Net(nodes=2, per_node=2, small_bytes=1 << 20, hierarchical="always")
    t = cost.Traffic()
    cost.q_all_reduce(t, cost.group(0, 4), 4097, _int4_nbytes, net)
    assert t.by_op == {"reduce_scatter": [8196, 0], "all_to_all": [0, 532], "all_gather": [8196, 536]}
    flat = cost.Traffic()
    cost.q_all_reduce(flat, cost.group(0, 2), 4097, _int4_nbytes, net)  # a sub-group: one hop
    assert set(flat.by_op) == {"all_to_all", "all_gather"}
    hsdp = estimate(Job(params=4096, strategy="HYBRID_SHARD", quant_grads="int4", units=(4096,)),
                    Cluster(nodes=2, per_node=2, hierarchical="always"))
    assert hsdp.phases["gradient reduce_scatter"] == (1056, 0)  # int4 of 2048: 1024 + 8 x 4


def _int4_nbytes(n: int) -> int:
    from commrt.quant.codecs import Codec
    return Codec(bits=4, block=256).nbytes(n)


def test_measured_levels_become_the_models_bandwidths():
    """--measure inside a job: the node group's busbw is intra-bw as is; the cross-node busbw is
    per rank while every local rank crosses at once, so the node's link (the model's inter-bw)
    carries per_node times it. A level the job lacks keeps the given figure and says so."""
    from commrt.plan.command import bandwidths
    intra, inter, lines = bandwidths({"intra": 2e9, "inter": 5e6}, 4, ("100GB/s", "12.5GB/s"))
    assert (float(intra), float(inter)) == (2e9, 2e7)
    assert all("measured" in line for line in lines)
    intra, inter, lines = bandwidths({"intra": 2e9}, 2, ("100GB/s", "12.5GB/s"))
    assert (float(intra), inter) == (2e9, "12.5GB/s") and "as given" in lines[1]
    assert parse_bandwidth(inter) == 12.5e9
    intra, inter, _ = bandwidths({"inter": 1e8}, 1, ("100GB/s", "12.5GB/s"))
    assert (intra, float(inter)) == ("100GB/s", 1e8)


def test_probe_sizes_parse_or_say_how():
    from commrt.plan.command import parse_size
    assert [parse_size(s) for s in ("16M", "4MiB", "65536", "2k", "1G")] == [16 << 20, 4 << 20, 65536, 2048, 1 << 30]
    with pytest.raises(ConfigError, match="use e.g. 4M"):
        parse_size("lots")


def test_auto_hierarchy_needs_a_measurable_gain_in_the_runtime_and_in_the_model():
    """dispatch.helps: the two levels must be HIERARCHY_HELPS (1.1x) faster; the estimator's "auto"
    predicts the same probe: a slow link across picks two levels, a link as fast per rank as the
    node does not (its world collectives stay flat, and so do their predicted bytes). Flat is the
    ring here; the table's Rabenseifner pairs ranks inside the node first and crosses nodes with
    half the buffer, as two levels do, so at 2 x 2 even the slow link keeps it flat."""
    import dataclasses
    from commrt.collectives.selection import table_from
    from commrt.topology import dispatch
    from commrt.plan import cost
    assert dispatch.helps(1.0, 0.5) and dispatch.helps(1.1, 1.0) and not dispatch.helps(1.05, 1.0)
    ring = table_from({"all_reduce": "ring"})
    slow = cost.Net(nodes=2, per_node=2, intra_bw=1.2e9, inter_bw=25e6, table=ring)
    fast = cost.Net(nodes=2, per_node=2, intra_bw=1e9, inter_bw=2e9, table=ring)
    assert cost.auto_helps(slow) and not cost.auto_helps(fast)
    assert not cost.auto_helps(dataclasses.replace(slow, table=cost.DEFAULT_TABLE))
    assert cost.hierarchical(slow, True, 16 << 20) and not cost.hierarchical(fast, True, 16 << 20)
    t = cost.Traffic()
    cost.collective(t, "all_reduce", cost.group(0, 4), 1 << 20, 4, fast)
    assert set(t.by_op) == {"all_reduce"}  # flat: no reduce_scatter / all_gather steps


@pytest.mark.parametrize("argv", [["--params", "nan"], ["--params", "inf"], ["--params", "1e30"],
                                  ["--params", "7e9", "--compare", "stage=abc"],
                                  ["--params", "7e9", "--compare", "params=xyz"],
                                  ["--params", "7e9", "--compare", "nodes=2.5"],
                                  ["--params", "7e9", "--bucket", "nan"],
                                  ["--params", "7e9", "--intra-bw", "1.2.3"],
                                  ["--params", "7e9", "--inter-bw", "1e999"],
                                  ["--params", "2e6", "--bucket", "1"],
                                  ["--params", "7e9", "--compare", "hierarchical=maybe"],
                                  ["--params", "7e9", "--pipeline", "2", "--per-node", "2", "--hidden", "-4"],
                                  ["--params", "7e9", "--pipeline", "2", "--per-node", "2", "--micro-batch", "0"]])
def test_unreadable_numbers_are_config_errors(argv):
    """Found by feeding each option nan, inf, a huge value or a wrong type: ValueError /
    OverflowError tracebacks (int(nan), int('abc'), float('1.2.3'), a list of 1e23 buckets);
    a bandwidth of 1e999 was inf, written as Infinity in --json (not JSON); --bucket 1 listed
    7e9 units (MemoryError after filling gigabytes); --compare hierarchical=maybe, a negative
    --hidden and --micro-batch 0 were estimated as if valid."""
    import argparse
    from commrt.plan import command
    p = argparse.ArgumentParser()
    command.add_parser(p.add_subparsers())
    with pytest.raises(ConfigError):
        command.render(p.parse_args(["estimate", *argv]))


def test_quantized_ops_take_two_hops_under_auto_where_the_exact_all_reduce_stays_flat():
    """The default table's Rabenseifner is within the probe's margin of two levels at 2 x 2, so
    "auto" keeps the exact all_reduce flat; a quantized op must not follow it there: its flat
    path sends the codes of both chunks for the other node across (qgZ's all_to_all), two hops
    only the node sum's. Both took the probe's verdict: 2 x 528 B across instead of 528."""
    from commrt.plan import cost
    net = cost.Net(nodes=2, per_node=2, small_bytes=1024)
    assert not cost.auto_helps(net)
    exact = cost.Traffic()
    cost.collective(exact, "all_reduce", cost.group(0, 4), 1 << 20, 4, net)
    assert set(exact.by_op) == {"all_reduce"}  # flat
    est = estimate(Job(params=4096, stage=3, dtype="bf16", quant_grads="int4", units=(4096,)),
                   Cluster(nodes=2, per_node=2, small_bytes=1024))
    assert est.phases["gradient reduce_scatter"] == (8192, 528)


def test_a_measure_probe_past_its_deadline_is_one_line_and_is_stopped(tmp_path, monkeypatch, capsys):
    """--measure's probe past its timeout was subprocess.TimeoutExpired's traceback (and the
    SIGKILL it sent left the probe's ranks running); now one line, exit 1, the probe stopped."""
    import os

    from commrt.plan import command
    pidfile = tmp_path / "pid"
    monkeypatch.setattr(command, "probe_command", lambda path: ["sh", "-c", f"echo $$ > {pidfile}; exec sleep 60"])
    monkeypatch.setattr(command, "PROBE_TIMEOUT_S", 2.0)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert cli.main(["estimate", "--params", "1e6", "--measure"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("commrt estimate: CommError: --measure: the bench probe") and "within 2 s" in err
    assert "\n" not in err
    with pytest.raises(ProcessLookupError):  # stopped and reaped
        os.kill(int(pidfile.read_text()), 0)
