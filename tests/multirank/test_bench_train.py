"""``commrt bench train`` at two ranks: every strategy that commrt carries sends bytes, and the
ones that move one gradient's worth (DataParallel, the engine's stages 0 and 1, torch DDP over
commrt) count about the same per step."""
from tests.unit.test_bench_train import ALL, bench, check_rows


def test_two_ranks_count_bytes_per_strategy(tmp_path):
    rows, stdout = bench(tmp_path, 2, "--stages", "dp,0,1,3", "--rounds", "1")
    assert [r["strategy"] for r in rows] == ALL[:3] + ["commrt stage 1"] + ALL[3:]
    check_rows(rows, stdout)
    sent = {r["strategy"]: r["intra_node_mb_per_step"] for r in rows}
    assert sent["plain torch"] == 0
    for name in ("commrt DataParallel", "commrt stage 0", "commrt stage 3", "torch DDP commrt", "torch FSDP2 commrt"):
        assert sent[name] > 0, (name, sent)
    # an all-reduce of the gradients, or stage 1's reduce-scatter plus the all-gather of the
    # stepped shards: within 10% (headers, the engine's norm check)
    for name in ("commrt stage 0", "commrt stage 1", "torch DDP commrt"):
        assert abs(sent[name] / sent["commrt DataParallel"] - 1) < 0.1, sent
