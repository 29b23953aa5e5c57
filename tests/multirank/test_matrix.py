"""The whole collective matrix on real ranks, for our backend and gloo through the same code."""
import pytest

from tests.multirank.harness import run_ranks

# generous on a shared 2-core machine; the harness's own deadline (which names the program and
# shows its output) comes before pytest-timeout's (120 s by default, too short for the matrix)
pytestmark = pytest.mark.timeout(330)


@pytest.mark.parametrize("backend", ["zmq", "gloo", pytest.param("zmq-shm", marks=pytest.mark.slow)])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_matrix(backend, world_size):
    """zmq: the TCP ring; zmq-shm: the intra-node shared-memory path (tests/multirank/test_shm.py
    covers it by default)."""
    name, _, intra = backend.partition("-")
    env = {"COMMRT_COMM_BACKEND": name, "COMMRT_COMM_INTRA_NODE": intra or "tcp"}
    _, out = run_ranks(world_size, "matrix", env=env, timeout_s=300)
    assert out.count("matrix passed") == world_size


def test_matrix_tiny_pipeline_pieces():
    """8 KiB pieces: every ring step is split into many pipelined pieces."""
    run_ranks(3, "matrix", env={"COMMRT_COMM_BACKEND": "zmq", "COMMRT_COMM_INTRA_NODE": "tcp",
                                "COMMRT_COMM_CHUNK_BYTES": "8192",
                                "COMMRT_COMM_SMALL_BYTES": "64"}, timeout_s=300)


@pytest.mark.parametrize("backend,intra", [("zmq", "tcp"), ("zmq", "shm"), ("gloo", "auto")])
def test_read_only_inputs_are_read_and_read_only_outputs_refused(backend, intra):
    """A read-only numpy input (np.frombuffer) of all_gather / reduce_scatter / all_to_all / send
    is read; a read-only buffer an op writes is a ValueError on every rank, and the group goes on
    (programs/readonly_inputs.py). Inputs used to be refused as outputs are."""
    _, out = run_ranks(2, "readonly_inputs", env={"COMMRT_COMM_BACKEND": backend, "COMMRT_COMM_INTRA_NODE": intra})
    assert out.count("read-only inputs passed") == 2


@pytest.fixture(scope="module", params=[("zmq", "tcp"), ("zmq", "shm"), ("gloo", "auto")], ids="-".join)
def dtype_ops(request):
    """programs/dtype_ops.py (int_avg, half_avg and bool_ops in one launch of 3 ranks: each launch
    imports torch on every rank) per backend and intra-node path, once for the three tests below."""
    backend, intra = request.param
    _, out = run_ranks(3, "dtype_ops", env={"COMMRT_COMM_BACKEND": backend, "COMMRT_COMM_INTRA_NODE": intra})
    return out


DTYPE_OPS = pytest.mark.xdist_group("dtype_ops")  # one worker runs the three: each launch runs once


@DTYPE_OPS
def test_integer_avg_does_not_wrap(dtype_ops):
    """int8 / uint8 / int32 AVG of values whose sum over 3 ranks overflows the dtype equals the
    floored int64 average (backends.base.widened), on the TCP and shared-memory paths and gloo."""
    assert dtype_ops.count("int avg passed") == 3


@DTYPE_OPS
def test_half_precision_avg_does_not_overflow(dtype_ops):
    """float16 AVG of values whose sum passes 65504 but whose mean fits equals the exact mean
    (each rank's part is divided first, reduce_ops.avg_part); random values are bit-identical
    on every rank (programs/half_avg.py). The sum used to overflow to inf."""
    assert dtype_ops.count("half avg passed") == 3


@DTYPE_OPS
def test_bool_tensors_and_arrays_reduce_as_logical_ops(dtype_ops):
    """bool through every collective, tensors and numpy arrays: SUM/MAX a logical or, PRODUCT/MIN
    a logical and, AVG a ValueError on every rank (programs/bool_ops.py). bool used to be refused
    by every op of the zmq backend as an unsupported dtype."""
    assert dtype_ops.count("bool ops passed") == 3
