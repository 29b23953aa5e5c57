"""The latency-optimal schedules on real ranks over TCP (issue 32.1 and 32.3): the collective
matrix with each algorithm pinned through [comm] algorithms at 1-5 ranks, and the messages per
small all_reduce counted by comm_stats() growing as log2 n."""
import re
import time

import pytest

from tests.multirank.harness import run_ranks

pytestmark = pytest.mark.timeout(330)

PINS = {
    "latency": "all_reduce=recursive_doubling, reduce=binomial, broadcast=binomial, all_gather=bruck",
    "rabenseifner": "all_reduce=rabenseifner, reduce=ring, broadcast=chain, all_gather=ring",
    "ring": "all_reduce=ring",
}


@pytest.mark.slow  # 25-35 s each under load: the default run has test_matrix at 2-4 ranks over the
# table (doubling, Rabenseifner and the ring by size) and tests/unit/test_scheduled.py with each
# algorithm pinned at 1-8 ranks on threads; these pin each one over real processes
@pytest.mark.parametrize("pin", list(PINS))
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])  # 3: the fold
def test_matrix_with_each_algorithm_pinned(pin, world_size):
    """4 and 5 ranks (fold and power of two beyond the unit tests' threads) take 55-105 s each on
    2 cores: slow. Measured 15 runs in 13 min (2026-11-26)."""
    env = {"COMMRT_COMM_BACKEND": "zmq", "COMMRT_COMM_INTRA_NODE": "tcp", "COMMRT_COMM_ALGORITHMS": PINS[pin],
           "COMMRT_COMM_CHUNK_BYTES": "65536"}  # pieces of 64 KiB: the large sizes take several
    _, out = run_ranks(world_size, "matrix_algos", env=env, timeout_s=300)
    assert out.count("matrix passed") == world_size


def _messages(n: int) -> tuple[set[float], set[str]]:
    env = {"COMMRT_COMM_BACKEND": "zmq", "COMMRT_COMM_INTRA_NODE": "tcp", "OMP_NUM_THREADS": "1"}
    _, out = run_ranks(n, "message_count", env=env, timeout_s=300)
    found = re.findall(r"messages per all_reduce (\S+) float sum (\w+)", out)
    assert len(found) == n, out[-3000:]
    return {float(m) for m, _ in found}, {d for _, d in found}


# 16 ranks: ~16 s under CI's load, slow (test_scale runs 16 ranks by default; CI's 15 minutes)
@pytest.mark.parametrize("n", [4, *(pytest.param(n, marks=pytest.mark.slow) for n in (16, 64))])
def test_small_all_reduce_messages_grow_as_log2_n(n):
    """Recursive doubling: log2 n messages per rank per 4 KiB all_reduce, counted by comm_stats()
    (the direct exchange it replaced sent n - 1: 3, 15, 63; the ring 2 (n - 1)). Every rank's sums
    equal the reference (programs/message_count.py) and its float sum is bit-identical on all
    ranks. 64 ranks took 73 s on this 2-core host: slow."""
    start = time.monotonic()
    messages, digests = _messages(n)
    assert messages == {float(n.bit_length() - 1)} and len(digests) == 1, (messages, digests)
    print(f"{n} ranks: {time.monotonic() - start:.1f} s")
