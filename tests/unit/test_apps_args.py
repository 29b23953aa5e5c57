"""The example jobs refuse options they cannot run, with a message naming the option, before any
rank starts (no process group: each case returns in milliseconds)."""
import pytest

from commrt.apps import pipeline_lm, train_lm


@pytest.mark.parametrize("argv,says", [
    (["--dim", "128", "--heads", "3"], "not a multiple of --heads 3"),
    (["--heads", "0"], "--heads 0"),
    (["--log-every", "0"], "--log-every 0"),
    (["--steps", "0"], "--steps 0"),
    (["--batch", "0"], "--batch 0"),
    (["--layers", "-1"], "--layers -1"),
    (["--stage", "4"], "--stage 4")])
def test_train_lm_refuses_options_it_cannot_run(argv, says, capsys, monkeypatch):
    """Found by running each option at 0 / out of range: --heads 3 with --dim 128 failed in the
    first forward's view on every rank, --log-every 0 with ZeroDivisionError on rank 0 after the
    first step, --steps 0 with an IndexError after the (empty) training."""
    monkeypatch.setattr(train_lm.commrt, "init_process_group", lambda *a, **k: pytest.fail("started"))
    with pytest.raises(SystemExit) as err:
        train_lm.main(argv)
    assert err.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.parametrize("argv,says", [
    (["--stages", "2", "--dp", "2", "--rows", "5"], "--rows 5"),
    (["--stages", "2", "--dp", "0"], "--dp 0"),
    (["--stages", "0"], "--stages 0"),
    (["--stages", "2", "--microbatches", "0"], "--microbatches 0"),
    (["--stages", "2", "--microbatches", "8", "--rows", "4"], "micro-batches"),
    (["--stages", "2", "--schedule", "pipedream", "--steps", "0"], "--steps 0"),
    (["--stages", "9"], "stages"),
    (["--stages", "4", "--bench"], "8 pipeline stages"),
    (["--stages", "2", "--bench", "--rounds", "0"], "--rounds 0"),
    (["--stages", "2", "--dp", "2", "--schedule", "pipedream"], "pipedream"),
    (["--stages", "1", "--schedule", "interleaved"], "interleaved")])
def test_pipeline_lm_refuses_options_it_cannot_run(argv, says, capsys, monkeypatch):
    """--rows 5 over --dp 2 gave replicas 3 and 2 rows (x.chunk), weighted alike by the gradient
    average, so the result was not the single-process batch's; --rows 5 over --dp 4 made 3 chunks
    and replica 3 an IndexError. PipeDream with --steps 0 failed unpacking an empty zip; 9 stages
    of a 7-layer model failed on every rank after the launch; so did PipeDream with --dp (a
    replicated stage, which it refuses) and interleaved on one pipeline rank (two stages on a
    group of one)."""
    monkeypatch.setattr(pipeline_lm, "self_launch", lambda *a: pytest.fail("launched"))
    with pytest.raises(SystemExit) as err:
        pipeline_lm.main(argv)
    assert err.value.code == 2 and says in capsys.readouterr().err


def test_pipeline_lm_checks_the_launched_world_not_stages():
    """Under a launcher the world is WORLD_SIZE (self_launch ignores --stages there)."""
    args = pipeline_lm.parse(["--stages", "9"])
    assert pipeline_lm.check_args(args, {"RANK": "0", "WORLD_SIZE": "2"}) is None
    assert "8 pipeline stages" in pipeline_lm.check_args(args, {"RANK": "0", "WORLD_SIZE": "8"})
    assert "9 pipeline stages" in pipeline_lm.check_args(args, {})
    launched = {"RANK": "0", "WORLD_SIZE": "3"}
    assert "does not divide" in pipeline_lm.check_args(pipeline_lm.parse(["--dp", "2"]), launched)
