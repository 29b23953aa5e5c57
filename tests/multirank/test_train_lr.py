"""The engine's learning-rate schedules with real ranks against single-process torch (AdamW +
LambdaLR with the same function of the step); the checks live in programs/lr_job.py."""
import pytest

from tests.multirank.harness import run_ranks


def test_scheduled_learning_rates_match_torch_and_survive_a_checkpoint(tmp_path):
    _, out = run_ranks(2, "lr_job", env={"COMMRT_COMM_BACKEND": "zmq", "COMMRT_TEST_TMP": str(tmp_path)},
                       timeout_s=120)
    for stage in (0, 3):
        for what in ("WarmupDecayLR", "WarmupCosineLR", "resumed schedule"):
            assert out.count(f"OK stage {stage} {what}\n") == 2, f"stage {stage} {what}:\n{out[-3000:]}"
    assert out.count("OK different learning rates refused\n") == 2, out[-3000:]


@pytest.mark.slow  # 20 s (4 ranks on 2 cores); the 2-rank test above covers stages 0 and 3 by default
def test_hybrid_sharding_and_hpz_follow_the_schedule(tmp_path):
    """4 ranks in groups of 2: HYBRID_SHARD's deferred unit steps (overlap_step) and hpZ."""
    _, out = run_ranks(4, "lr_job", "hybrid", env={"COMMRT_COMM_BACKEND": "zmq"}, timeout_s=180)
    for name in ("HYBRID_SHARD", "hpZ"):
        assert out.count(f"OK {name} WarmupDecayLR\n") == 4, f"{name}:\n{out[-3000:]}"
