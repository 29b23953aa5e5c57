import pytest

from tests.multirank.harness import run_ranks


@pytest.mark.parametrize("backend", ["zmq", "gloo"])
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_features(backend, world_size):
    _, out = run_ranks(world_size, "features", env={"COMMRT_COMM_BACKEND": backend})
    assert out.count("features passed") == world_size
