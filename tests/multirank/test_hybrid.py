"""Hybrid sharding (FSDP HYBRID_SHARD / _HYBRID_SHARD_ZERO2, DeepSpeed MiCS) and ZeRO++ hpZ at
4 ranks in shard groups of 2 (a 2x2 layout set by configuration on loopback), against
single-process training; the checks live in programs/hybrid_job.py and print 'OK <case>'."""
import pytest

from tests.multirank.harness import run_ranks

FAST = [f"{layout} {kind}" for layout in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2", "MiCS", "hpZ")
        for kind in ("adamw", "accumulation+clipping")] + [
    "hpZ prefetch 0", "hpZ prefetch 50000000", "HYBRID_SHARD overlap_step micro 1", "HYBRID_SHARD overlap_step micro 2",
    "checkpoint HYBRID_SHARD -> hpZ", "checkpoint hpZ -> _HYBRID_SHARD_ZERO2", "checkpoint MiCS -> FULL_SHARD",
    "checkpoint _HYBRID_SHARD_ZERO2 -> HYBRID_SHARD", "hpZ converges like stage 3", "bytes per step off the shard group",
    "refused {'sharding_strategy': 'HYBRID_SHARD', 'shard_group_size': 8}",
    "refused {'stage': 3, 'zero_hpz_partition_size': 3}", "memory accounting"]
GRID = [f"{layout} {kind}" for layout in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD",
                                          "_HYBRID_SHARD_ZERO2", "MiCS", "hpZ")
        for kind in ("adamw", "lamb", "accumulation+clipping")]


def _check(out: str, cases: list[str], nproc: int = 4) -> None:
    for case in cases:
        assert out.count(f"OK {case}") == nproc, f"{case!r} missing:\n{out[-4000:]}"


@pytest.fixture(scope="module")
def hybrid_and_defer_at_four(tmp_path_factory):
    """One launch of 4 ranks for the two tests below (a launch costs ~8 s of imports at 4 ranks on
    two cores): programs/hybrid_job.py's fast tier, then programs/defer_job.py's cases."""
    tmp = tmp_path_factory.mktemp("hybrid")
    _, out = run_ranks(4, "hybrid_job", "errors", "hybrid", "checkpoint", "convergence", "bytes", "defer",
                       timeout_s=300, env={"COMMRT_COMM_BACKEND": "zmq", "COMMRT_TEST_TMP": str(tmp)})
    return out


ONE_LAUNCH = pytest.mark.xdist_group("hybrid_and_defer")  # one worker runs both: the launch runs once


@ONE_LAUNCH
def test_hybrid_and_hpz_equal_single_process(hybrid_and_defer_at_four):
    _check(hybrid_and_defer_at_four, FAST)


def test_overlap_step_over_gloo(tmp_path):
    """gloo's works learn of their completion only when asked (torch_backend.TorchWork): the
    chained replica all-reduce must still start and its landing end (it waited forever)."""
    _, out = run_ranks(4, "hybrid_job", "overlap", timeout_s=60,
                       env={"COMMRT_COMM_BACKEND": "gloo", "COMMRT_TEST_TMP": str(tmp_path)})
    _check(out, ["HYBRID_SHARD overlap_step micro 1", "HYBRID_SHARD overlap_step micro 2"])


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["zmq", "gloo"])
def test_every_strategy_equals_single_process(tmp_path, backend):
    _, out = run_ranks(4, "hybrid_job", "strategies", timeout_s=600,
                       env={"COMMRT_COMM_BACKEND": backend, "COMMRT_TEST_TMP": str(tmp_path)})
    _check(out, GRID)


DEFER = ["a unit reduced after the held ones (spare 16)", "a unit reduced after the held ones (spare 8)",
         "step() twice", "learning rate changed after step()", "non-finite gradients, skip",
         "non-finite gradients, raise", "settle, state_dict, checkpoint, full_state_dict mid-run",
         "memory_report's gradients after step()"]


@ONE_LAUNCH
def test_overlap_step_equals_the_unoverlapped_step_where_its_order_could_go_wrong(hybrid_and_defer_at_four):
    """programs/defer_job.py: overlap_step on and off, bit for bit, in the cases a review found
    wrong (a unit reduced after the held ones, step() twice, a learning rate set after step(), a
    landing's memory) and around settle, checkpoints and non-finite gradients."""
    out = hybrid_and_defer_at_four
    assert "FAIL " not in out, "\n".join(line for line in out.splitlines() if "FAIL " in line)
    for case in DEFER:
        assert out.count(f"OK {case}") == 4, f"{case!r} missing:\n{out[-4000:]}"
