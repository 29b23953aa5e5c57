"""``commrt bench train`` end to end (the launcher starts it): every strategy gets a row, the plain
loop is the reference, bytes are counted where commrt carries them and "n/a" over gloo, and the
JSON matches the table. One rank here; two in tests/multirank/test_bench_train.py."""
import json
import os
import subprocess
import sys

import pytest

from commrt.bench.train import build_parser, strategies
from commrt.runtime.config import load_config

TINY = ["--dim", "32", "--layers", "1", "--seq", "8", "--vocab", "64", "--steps", "3", "--warmup", "1"]
ALL = ["plain torch", "commrt DataParallel", "commrt stage 0", "commrt stage 3", "torch DDP gloo",
       "torch DDP commrt", "torch FSDP2 gloo", "torch FSDP2 commrt"]


def bench(tmp_path, ranks: int, *extra: str) -> tuple[list[dict], str]:
    out = tmp_path / "train.json"
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    env.pop("RANK", None)
    proc = subprocess.run([sys.executable, "-m", "commrt.cli", "bench", "train", "-n", str(ranks), *TINY,
                           "--json", str(out), *extra], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())["rows"], proc.stdout


def check_rows(rows: list[dict], stdout: str) -> None:
    assert rows[0]["strategy"] == "plain torch" and rows[0]["efficiency"] == 1.0 and rows[0]["breakdown_ms"] is None
    for r in rows:
        assert r["step_ms"] > 0 and r["samples_per_s"] > 0 and r["peak_rss_mb"] > 0
        assert r["round_ms"] and all(len(t) == len(r["round_ms"][0]) > 0 for t in r["round_ms"])  # per round
        assert r["strategy"] in stdout
        if "gloo" in r["strategy"]:  # commrt cannot count gloo's bytes
            assert r["intra_node_mb_per_step"] is None and r["inter_node_mb_per_step"] is None
        else:
            assert r["intra_node_mb_per_step"] >= 0 and r["inter_node_mb_per_step"] == 0  # one host
        if r["strategy"].startswith("commrt"):
            assert r["breakdown_ms"]["total"] > 0


def test_one_rank_run_reports_every_strategy(tmp_path):
    rows, stdout = bench(tmp_path, 1, "--stages", "dp,0,3", "--rounds", "1")
    assert [r["strategy"] for r in rows] == ALL
    check_rows(rows, stdout)
    assert all(r["intra_node_mb_per_step"] in (0, None) for r in rows)  # one rank sends nothing
    assert "n/a" in stdout


def test_strategies_parse_and_refuse_unknown_peers():
    parse = build_parser().parse_args
    assert [n for n, _, _ in strategies(parse(["--stages", "1", "--peers", ""]))] == ["plain torch", "commrt stage 1"]
    assert [k for _, k, _ in strategies(parse(["--stages", "dp", "--peers", "fsdp-commrt"]))] == ["plain", "dp", "fsdp"]
    with pytest.raises(SystemExit, match="not 'ddp-nccl'"):
        strategies(parse(["--peers", "ddp-nccl"]))


def test_bucket_sizes_make_strategies_of_their_own():
    """dp:N / 0:N ... 2:N: the same strategy with gradient buckets of N MiB, beside the default."""
    parse = build_parser().parse_args
    plan = strategies(parse(["--stages", "dp,dp:4,2:8", "--peers", ""]))
    assert [n for n, _, _ in plan] == ["plain torch", "commrt DataParallel", "commrt DataParallel 4MiB",
                                       "commrt stage 2 8MiB"]
    assert plan[2][2] == 4.0 and plan[3][2].zero.stage == 2 and plan[3][2].zero.reduce_bucket_size == 8 << 18
    for bad in ("3:4", "dp:0", "dp:x", "hpz:4"):
        with pytest.raises(SystemExit, match="a bucket size in MiB"):
            strategies(parse(["--stages", bad]))


def test_grouped_strategies_build_their_configs_and_refuse_bad_groups():
    parse = build_parser().parse_args
    plan = strategies(parse(["-n", "4", "--stages", "hpz,hybrid,mics,zeropp", "--peers", ""]))
    assert [n for n, _, _ in plan][1:] == ["commrt hpZ /2", "commrt HYBRID_SHARD /2", "commrt MiCS /2",
                                           "commrt ZeRO++ /2"]
    hpz, hybrid, mics, zeropp = (c.zero for _, _, c in plan[1:])
    assert (hpz.stage, hpz.zero_hpz_partition_size) == (3, 2)
    assert hybrid.hybrid and hybrid.shard_group_size == 2
    assert mics.mics_shard_size == 2
    assert zeropp.zero_quantized_weights and zeropp.zero_quantized_gradients and zeropp.zero_hpz_partition_size == 2
    with pytest.raises(SystemExit, match="does not divide"):
        strategies(parse(["-n", "4", "--group", "3", "--stages", "mics"]))
    with pytest.raises(SystemExit, match="not 'zero4'"):
        strategies(parse(["--stages", "zero4"]))


@pytest.mark.parametrize("argv,says", [
    (["--stages", "7"], "not '7'"), (["--stages", "foo"], "not 'foo'"), (["--dim", "30", "--heads", "4"], "--heads 4"),
    (["--rounds", "0"], "--rounds 0"), (["--warmup", "-1"], "--warmup"), (["--steps", "2", "--warmup", "2"], "--steps"),
    (["--peers", "ddp-nccl"], "not 'ddp-nccl'"), (["-n", "4", "--group", "3", "--stages", "mics"], "does not divide"),
    (["--manual-gc-interval", "-1"], "--manual-gc-interval"), (["--stages", "dp:0"], "a bucket size")])
def test_options_that_cannot_run_are_refused_before_the_launch(argv, says, monkeypatch):
    """Found by running each option out of range: --stages 7 (isdigit) became 'commrt stage 7' and
    failed in TrainConfig on every rank after the start-up, as did an unknown name, --heads not
    dividing --dim and --rounds 0; --warmup -1 took the memory and bytes figures as step times."""
    import commrt.launch
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(commrt.launch, "launch", lambda *a, **k: pytest.fail("launched"))
    from commrt.bench.train import main
    with pytest.raises(SystemExit, match=says):
        main(argv)


def test_the_table_stays_aligned_with_long_strategy_names():
    """'commrt HYBRID_SHARD /16' (23 characters) pushed its row one column right of the header."""
    from commrt.bench.train import table
    row = {"ranks": 32, "step_ms": 1.0, "samples_per_s": 1.0, "efficiency": 1.0, "intra_node_mb_per_step": 0.0,
           "inter_node_mb_per_step": None, "peak_rss_mb": 10.0, "breakdown_ms": None}
    rows = [{**row, "strategy": "plain torch"}, {**row, "strategy": "commrt HYBRID_SHARD /16"}]
    head, *lines = table(rows).splitlines()
    assert [line.index(" 32 ") + 3 for line in lines] == [head.index("ranks") + 5] * 2  # right-aligned alike


def test_torch_groups_reach_rank_0_at_master_addr(monkeypatch):
    """The gloo rows' TCPStore was dialled at 127.0.0.1: on a multi-node launch the other nodes'
    ranks dialled their own host and waited out the 120 s store timeout. Rank 1 of 2 here."""
    from commrt.bench import train_peers
    dialled = []

    class Store:
        def __init__(self, host, port, world, master, **kw):
            dialled.append((host, port, master))
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    monkeypatch.setattr(train_peers.tdist, "TCPStore", Store)
    monkeypatch.setattr(train_peers.tdist, "init_process_group", lambda *a, **k: None)
    monkeypatch.setattr(train_peers.tdist, "new_group", lambda *a, **k: "commrt group")
    monkeypatch.setattr(train_peers.commrt, "get_rank", lambda: 1)
    monkeypatch.setattr(train_peers.commrt, "get_world_size", lambda: 2)
    monkeypatch.setattr(train_peers.commrt, "broadcast", lambda t, src: t.fill_(4242))
    monkeypatch.setattr(train_peers.commrt, "get_config", lambda: load_config(environ={}))
    train_peers.TorchGroups()
    assert dialled == [("10.1.2.3", 4242, False)]
