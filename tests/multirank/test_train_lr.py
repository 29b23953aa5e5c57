"""The engine's learning-rate schedules with real ranks against single-process torch (AdamW +
LambdaLR with the same function of the step); the checks live in programs/lr_job.py."""
from tests.multirank.harness import run_ranks


def test_scheduled_learning_rates_match_torch_and_survive_a_checkpoint(tmp_path):
    _, out = run_ranks(2, "lr_job", env={"COMMRT_COMM_BACKEND": "zmq", "COMMRT_TEST_TMP": str(tmp_path)},
                       timeout_s=120)
    for stage in (0, 3):
        for what in ("WarmupDecayLR", "WarmupCosineLR", "resumed schedule"):
            assert out.count(f"OK stage {stage} {what}\n") == 2, f"stage {stage} {what}:\n{out[-3000:]}"
    assert out.count("OK different learning rates refused\n") == 2, out[-3000:]
