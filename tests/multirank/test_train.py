"""DataParallel and ZeRO stages 0-3 against single-process training, with real ranks (the checks
themselves live in programs/zero_job.py and print 'OK <case>')."""
import pytest

from tests.multirank.harness import run_ranks

CASES = (["stage 0 adamw", "stage 0 lamb", "stage 0 accumulation+clipping", "stage 0 gradients in the bucket"]
         + [f"stage {s} {k}" for s in (1, 2, 3) for k in ("adamw", "lamb", "accumulation+clipping")]
         + [f"stage {s} parameter unused on some ranks" for s in (0, 1, 2)]
         + ["stage 3 modules registered out of order", "stage 1 bf16", "stage 3 bf16", "checkpoint stage 2 -> stage 3",
            "resume stage 1 from file", "resume stage 1 from state_dict", "resume stage 3 from file",
            "resume stage 3 from state_dict", "memory accounting", "non-finite gradients: skip",
            "non-finite gradients: raise", "DataParallel", "DataParallel no_sync", "DataParallel bf16 gradients",
            "DataParallel fp16 gradients", "DataParallel overlapped = one bucket",
            "DataParallel parameter unused on some ranks", "DataParallel mixed dtypes",
            "DataParallel two backwards of one forward", "DataParallel evaluation on one rank",
            "DataParallel overlapped = torch", "stage 3 prefetched = serial", "stage 3 prefetched = torch"])


@pytest.fixture(scope="module")
def zmq_at_two(tmp_path_factory):
    """zero_job's default cases, its torn checkpoints and its transformer layers at 2 ranks over
    zmq, launched once (each launch imports torch on every rank) for the [zmq-2] case, the
    torn-checkpoint, transformer and reshard tests (the last loads the checkpoint this run's
    checkpoint_case saved, ckpt-2)."""
    tmp = tmp_path_factory.mktemp("zero_job_zmq_2")
    _, out = run_ranks(2, "zero_job", *DEFAULT_MODES, "torn", "transformer", timeout_s=240,
                       env={"COMMRT_COMM_BACKEND": "zmq", "COMMRT_TEST_TMP": str(tmp)})
    return tmp, out


DEFAULT_MODES = ("zero", "checkpoint", "memory", "nonfinite", "ddp", "overlap")  # zero_job's, without arguments
AT_TWO = pytest.mark.xdist_group("zero_job_zmq_2")  # one worker runs these: the launch runs once


@pytest.mark.parametrize("backend,nproc", [("zmq", 1), pytest.param("zmq", 2, marks=AT_TWO), ("zmq", 3), ("zmq", 4),
                                           ("gloo", 2)])
def test_training_layers_equal_single_process(tmp_path, backend, nproc, request):
    if (backend, nproc) == ("zmq", 2):
        _, out = request.getfixturevalue("zmq_at_two")
    else:
        _, out = run_ranks(nproc, "zero_job", timeout_s=180,
                           env={"COMMRT_COMM_BACKEND": backend, "COMMRT_TEST_TMP": str(tmp_path)})
    for case in CASES:
        want = 3 * nproc if case == "stage 3 modules registered out of order" else nproc  # 3 prefetch sizes
        assert out.count(f"OK {case}\n") == want, f"{case!r} missing:\n{out[-4000:]}"


@AT_TWO
def test_checkpoint_reshards_to_another_world_size(tmp_path, zmq_at_two):
    saved, _ = zmq_at_two  # a 2-rank run saved ckpt-2 (stage 2, AdamW, after 2 steps)
    env = {"COMMRT_COMM_BACKEND": "zmq", "COMMRT_TEST_TMP": str(tmp_path)}
    (tmp_path / "ckpt-3").symlink_to(saved / "ckpt-2")  # the 3-rank job reads the 2-rank files
    _, out = run_ranks(3, "zero_job", "reshard", env=env, timeout_s=120)
    assert out.count("OK resharded 2 -> 3 ranks") == 3, out[-3000:]


@AT_TWO
def test_an_interrupted_checkpoint_save_is_refused(zmq_at_two):
    """Issue 13.20: a set mixing two saves' files, or one whose save never completed."""
    _, out = zmq_at_two
    assert out.count("OK refused mixed checkpoint") == 2 and out.count("OK refused unfinished checkpoint") == 2, out[-3000:]


@AT_TWO
def test_stage3_and_hpz_train_torch_transformer_layers(zmq_at_two):
    """Issue 30.16 at 2 ranks (fp32: gathers across ranks), and 30.22's chained replica all-reduce."""
    _, out = zmq_at_two
    for case in ("stage 3 transformer", "hpZ transformer", "hybrid qgZ stream = serial"):
        assert out.count(f"OK {case}\n") == 2, f"{case!r} missing:\n{out[-3000:]}"
