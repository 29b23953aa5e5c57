"""Pipeline parallelism with real ranks (issue 16): tensor-list transfers, GPipe / 1F1B /
interleaved training equal to single-process training, activation memory by count, PipeDream's
weight stashing, and a dead stage named on the others. The checks live in
programs/pipeline_job.py and print 'OK <case>'."""
import pytest

from tests.multirank.harness import run_ranks

MICRO = [1, 3, 4, 8]
KINDS = ["gpipe", "1f1b", "interleaved"]


def _env(backend):
    return {"COMMRT_COMM_BACKEND": backend}


AT_TWO = pytest.mark.xdist_group("pipeline_job_zmq_2")  # one worker runs these: the launch below runs once


@pytest.fixture(scope="module")
def zmq_at_two():
    """One launch of pipeline_job at 2 ranks over zmq for the 2-rank zmq cases of the tests
    below (each launch imports torch on every rank)."""
    _, out = run_ranks(2, "pipeline_job", "p2p,layouts,memory,pipedream", env=_env("zmq"), timeout_s=300)
    return out


def _job(request, backend: str, nproc: int, mode: str, timeout_s: float) -> str:
    """pipeline_job ``mode``'s output: zmq_at_two's at 2 ranks over zmq, else a launch of its own."""
    if (backend, nproc) == ("zmq", 2):
        return request.getfixturevalue("zmq_at_two")
    return run_ranks(nproc, "pipeline_job", mode, env=_env(backend), timeout_s=timeout_s)[1]


@pytest.mark.parametrize("backend,nproc", [pytest.param("zmq", 2, marks=AT_TWO), ("zmq", 3), ("gloo", 2)])
def test_tensor_lists_of_unknown_shape_and_batch_isend_irecv(backend, nproc, request):
    out = _job(request, backend, nproc, "p2p", 120)
    assert out.count("OK p2p\n") == nproc, out[-3000:]


def _train(backend, nproc, micro):
    _, out = run_ranks(nproc, "pipeline_job", "train", *map(str, micro), env=_env(backend), timeout_s=300)
    for kind in KINDS:
        for m in micro:
            assert out.count(f"OK train {kind} m={m}\n") == nproc, f"{kind} m={m} missing:\n{out[-3000:]}"


@pytest.mark.parametrize("backend,nproc", [("zmq", 2), ("zmq", 3), ("gloo", 2)])
def test_schedules_train_like_a_single_process(backend, nproc):
    _train(backend, nproc, MICRO)


@pytest.mark.parametrize("backend", [pytest.param("zmq", marks=AT_TWO), "gloo"])
def test_micro_batch_shapes_that_change_between_steps_train_like_a_single_process(backend, request):
    """From its second step a schedule sends each tensor list as one message sized by the layout
    of the step before (channels.py); batches of 12, 12, 9, 9, 12 rows change that layout twice."""
    out = _job(request, backend, 2, "layouts", 120)
    for kind in KINDS:
        assert out.count(f"OK train {kind} m=4 rows=12,12,9,9,12\n") == 2, f"{kind}:\n{out[-3000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("backend,nproc", [("zmq", 4), ("gloo", 3), ("gloo", 4)])
def test_schedules_train_like_a_single_process_at_more_ranks(backend, nproc):
    _train(backend, nproc, MICRO)


@pytest.mark.parametrize("nproc", [pytest.param(2, marks=AT_TWO), 3])
def test_1f1b_keeps_at_most_num_stages_micro_batches_in_flight_and_gpipe_all(nproc, request):
    out = _job(request, "zmq", nproc, "memory", 120)
    for rank in range(nproc):  # stage r holds num_stages - r under 1F1B, all 8 under GPipe
        assert f"OK memory gpipe=8 1f1b={nproc - rank}\n" in out, out[-3000:]


@pytest.mark.parametrize("nproc", [pytest.param(2, marks=AT_TWO), 3])
def test_pipedream_equals_the_2bw_rule_only_with_weight_stashing(nproc, request):
    out = _job(request, "zmq", nproc, "pipedream", 180)
    for m in (1, 2, 4):
        assert out.count(f"OK pipedream m={m}\n") == nproc, out[-3000:]


@pytest.mark.parametrize("backend", ["zmq", "gloo"])  # gloo: its RuntimeError named no rank
def test_a_dead_stage_is_peer_lost_naming_it_on_the_others(backend):
    _, out = run_ranks(3, "pipeline_job", "die", env={**_env(backend), "COMMRT_COMM_TIMEOUT_S": "20"},
                       timeout_s=120, expect_fail=True, stop_on_failure=False)
    assert out.count("OK peer lost 2\n") == 2, out[-3000:]


def test_pipeline_by_data_parallel_trains_like_a_single_process():
    """2 stages x 2 replicas: GPipe and 1F1B (and interleaved) with DataParallel and ZeRO stage 1
    over each stage's replicas equal single-process training on the global batches; without the
    reduction they do not (checked in the same run)."""
    _, out = run_ranks(4, "pipeline_job", "twod", "3", "4", env=_env("zmq"), timeout_s=300)
    for kind in ("gpipe", "1f1b"):
        for wrap in ("ddp", "zero1", "none"):
            for m in (3, 4):
                assert out.count(f"OK twod {kind} {wrap} m={m}\n") == 4, f"{kind} {wrap} m={m}:\n{out[-3000:]}"
    assert out.count("OK twod interleaved ddp m=4\n") == 4, out[-3000:]


@pytest.mark.parametrize("dp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_pipeline_of_engines_clips_and_skips_by_the_whole_model_like_a_single_process(dp):
    """2 stages of ZeRO stage 1 engines (dp replicas each): gradient clipping uses the whole
    model's norm, and an inf gradient on the last stage only skips the step on every stage, as
    in one process. Each stage's engine used its own part's norm (stage 0 clipped by 0.08 where
    the model's was 0.29) and only the stage that saw the inf skipped, the other stepping on.
    An interleaved pipeline of clipping engines is refused (ConfigError)."""
    _, out = run_ranks(2 * dp, "pipeline_engines", "clip", "nonfinite", "interleaved", env={**_env("zmq"), "PIPELINE_DP": str(dp)},
                       timeout_s=120)
    for case in ("clip", "nonfinite", "interleaved"):
        assert out.count(f"OK {case}\n") == 2 * dp, f"{case}:\n{out[-3000:]}"


EDGES_ENV = {**_env("zmq"), "COMMRT_COMM_TIMEOUT_S": "60"}  # a regression waits out 60 s: the harness stops at 45


# The tests on the fixtures below run on one xdist worker: each fixture's launch then runs once
# (without it both workers launched edges_at_two_ranks, ~14 s each in CI).
EDGES = pytest.mark.xdist_group("pipeline_edges")


@pytest.fixture(scope="module")
def edges_at_two_ranks():
    """One launch for the 2-rank cases of programs/pipeline_edges.py (each launch costs seconds);
    every test below checks its own lines of that output."""
    _, out = run_ranks(2, "pipeline_edges", "layouts", "inplace", "mismatch", "fails=1:loss", "fails=0:forward",
                       "fails=0:input", "unsendable=complex", "unsendable=many", "mask", env=EDGES_ENV, timeout_s=45)
    return out


@pytest.fixture(scope="module")
def edges_at_three_ranks():
    """The 3-rank cases in one launch; the last kills rank 2 (so the launch fails by design)."""
    _, out = run_ranks(3, "pipeline_edges", "fails=1:backward", "fails=2:forward", "die_in_subgroup", env=EDGES_ENV,
                       timeout_s=45, expect_fail=True, stop_on_failure=False)
    return out


@EDGES
def test_layouts_that_change_in_every_way_train_like_a_single_process(edges_at_two_ranks):
    """Stage 0 sends 2 to 4 tensors whose rows, dtype, count, requires_grad and size (past
    COMBINE_MAX and back) change between steps and, in one step, between micro-batches; stage 1
    ignores one and uses another only sometimes (an empty gradient back). Outputs, losses and
    parameters equal a single process's after every step, and no returned output changes later."""
    for case in ("gpipe m=4", "1f1b m=3"):
        assert edges_at_two_ranks.count(f"OK layouts {case}\n") == 2, edges_at_two_ranks[-3000:]


@EDGES
def test_a_stage_that_modifies_its_received_input_in_place_trains_like_a_single_process(edges_at_two_ranks):
    """Stage 1 starts with nn.ReLU(inplace=True): the received activation was an autograd leaf,
    and in-place on a leaf that requires grad is a RuntimeError that one process never meets."""
    for kind in ("gpipe", "1f1b"):
        assert edges_at_two_ranks.count(f"OK inplace {kind}\n") == 2, edges_at_two_ranks[-3000:]


@EDGES
def test_schedules_built_with_other_micro_batch_counts_are_a_config_error(edges_at_two_ranks):
    """Rank 0 built for 4 micro-batches, rank 1 for 3: rank 1's first receive raises ConfigError
    naming both counts and rank 0 gets it as StageFailed (before: rank 1 finished its step and
    rank 0 waited out its deadline for a gradient that never came)."""
    assert edges_at_two_ranks.count("OK mismatch\n") == 2, edges_at_two_ranks[-3000:]


@EDGES
def test_a_stage_that_raises_is_named_on_the_others_at_once(edges_at_two_ranks, edges_at_three_ranks):
    """A rank whose step raises (its forward, its loss, its backward, its inputs refused) and
    that stays alive tells the ranks still waiting on it, which tell theirs: each raises
    StageFailed naming the rank and its error, and no later step runs. Before, they waited out
    the whole deadline and then blamed a silent peer."""
    for case in ("1 loss", "0 forward", "0 input"):
        assert edges_at_two_ranks.count(f"OK fails {case}\n") == 2, edges_at_two_ranks[-3000:]
    for case in ("1 backward", "2 forward"):  # told by the failed rank itself, and through rank 1
        assert edges_at_three_ranks.count(f"OK fails {case}\n") == 3, edges_at_three_ranks[-3000:]


def test_a_stage_that_raises_over_gloo_is_named_at_once():
    """The same over gloo, which sends only into a posted receive: the step must not wait for
    its pending sends once it has failed (it waited until the failed rank exited)."""
    _, out = run_ranks(2, "pipeline_edges", "fails=1:loss", "fails=0:forward", "mismatch",
                       env={**EDGES_ENV, **_env("gloo")}, timeout_s=45)
    for case in ("fails 1 loss", "fails 0 forward", "mismatch"):
        assert out.count(f"OK {case}\n") == 2, out[-3000:]


@EDGES
def test_an_output_that_cannot_be_sent_is_named_at_once_on_the_stage_waiting_for_it(edges_at_two_ranks):
    """Stage 0 returns a complex64 tensor (not a wire dtype), then 65 tensors (more than a header
    holds), with one micro-batch: its send raised before anything went but counted as sent, so
    the notice did not follow and stage 1 waited out the 60 s deadline for a PeerLost naming a
    live rank (review_pp item 2). Now rank 0 raises naming the output and rank 1 StageFailed."""
    out = edges_at_two_ranks
    for what in ("complex", "many"):
        assert out.count(f"OK unsendable {what}\n") == 2, out[-3000:]
    for kind in ("gpipe", "1f1b"):  # a bool mask is a wire dtype (wire version 3): it crosses, and trains
        assert out.count(f"OK mask {kind}\n") == 2, out[-3000:]


@EDGES
def test_a_dead_stage_of_a_pipeline_subgroup_is_named_by_its_global_rank(edges_at_three_ranks):
    """A pipeline on ranks [0, 2] of 3, as a device mesh's "pp" groups are; rank 2 dies mid-step."""
    assert "OK subgroup peer lost 2\n" in edges_at_three_ranks, edges_at_three_ranks[-3000:]
