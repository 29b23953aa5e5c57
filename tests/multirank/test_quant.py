"""Quantized collectives on real ranks against an fp64 reference within the codec's bound."""
import pytest

from tests.multirank.harness import run_ranks


@pytest.mark.parametrize("backend", ["zmq", "gloo"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_quantized_collectives_within_bound(backend, world_size):
    _, out = run_ranks(world_size, "quant_job", env={"COMMRT_COMM_BACKEND": backend}, timeout_s=180)
    assert out.count("quant passed") == world_size
    assert out.count("two-hop all_reduce within bound") == (4 if world_size == 4 else 0)
    # int8 <= 0.26x and int4 <= 0.135x the exact all_reduce's bytes, as our transport counted them
    assert out.count("transport bytes") == (2 * world_size if backend == "zmq" and world_size > 1 else 0)


def test_small_blocks_fp16_scales_stochastic_rounding():
    """[quant] block=64, fp16 scales, stochastic rounding (the bound doubles: a whole scale)."""
    env = {"COMMRT_COMM_BACKEND": "zmq", "COMMRT_QUANT_BLOCK": "64", "COMMRT_QUANT_SCALE_DTYPE": "fp16",
           "COMMRT_QUANT_ROUNDING": "stochastic"}
    _, out = run_ranks(3, "quant_job", env=env, timeout_s=180)
    assert out.count("quant passed") == 3


def test_a_broken_codec_fails_the_bound():
    """Truncating instead of rounding (errors up to a whole scale) must be caught."""
    _, out = run_ranks(2, "quant_job", env={"COMMRT_COMM_BACKEND": "zmq", "COMMRT_QUANT_TEST_BROKEN": "1"},
                       timeout_s=180, expect_fail=True)
    assert "exceeds its bound" in out


def _train(steps: int, *more: str) -> str:
    _, out = run_ranks(2, "quant_train", str(steps), *more, env={"COMMRT_COMM_BACKEND": "zmq"}, timeout_s=500)
    assert out.count("quant training passed") == 2
    return out


@pytest.fixture(scope="module")
def train_24_and_feedback():
    """24 training steps, then programs/quant_feedback.py's checks, in one launch of 2 ranks."""
    return _train(24, "feedback")


AT_TWO = pytest.mark.xdist_group("quant_train_at_two")  # one worker runs both: the launch runs once


@AT_TWO
def test_quantized_training_tracks_fp32(train_24_and_feedback):
    """DataParallel int8 / int4+feedback and ZeRO-3 qwZ+qgZ(+LoCo) train a TinyLM to within a
    fraction (5% / 10%) of the loss drop of the same training in fp32 (checked by the program)."""
    assert train_24_and_feedback.count("quant training passed") == 2


@pytest.mark.slow
def test_quantized_training_tracks_fp32_over_120_steps():
    _train(120)


@AT_TWO
def test_error_feedback_starts_afresh_when_the_size_changes(train_24_and_feedback):
    assert train_24_and_feedback.count("quant feedback passed") == 2
