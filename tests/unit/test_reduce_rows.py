"""reduce_ops.reduce_rows_: the one-step shared-memory all-reduce reduces every rank's row in one
numpy call; its result must be reduce_arrays_' (rank order, one element at a time) bit for bit,
or the ranks of a small op would disagree with the rounds, the TCP path and a single process."""
import numpy as np
import pytest

from commrt.collectives.reduce_ops import ReduceOp, reduce_arrays_, reduce_rows_


def _rows(rng, dtype, n: int, numel: int) -> np.ndarray:
    """n rows 64-byte aligned in one buffer, as Channel.rows lays them out."""
    dt = np.dtype(dtype)
    row = -(-numel * dt.itemsize // 64) * 64
    rows = np.ndarray((n, numel), dt, buffer=np.zeros(n * row, np.uint8), strides=(row, dt.itemsize))
    scale = 10.0 ** rng.integers(-3, 4, size=(n, numel))  # magnitudes that make the order matter
    rows[:] = (rng.standard_normal((n, numel)) * scale * (100 if dt.kind in "iu" else 1)).astype(dt)
    return rows


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int8, np.int32, np.int64])
@pytest.mark.parametrize("op", list(ReduceOp))
def test_rows_reduce_in_rank_order_bit_for_bit(dtype, op):
    rng = np.random.default_rng(7)
    with np.errstate(all="ignore"):
        for n in (2, 3, 5, 8, 16, 64):
            for numel in (2, 3, 17, 1024, 4099):
                rows = _rows(rng, dtype, n, numel)
                got, want = np.empty(numel, dtype), np.empty(numel, dtype)
                reduce_rows_(got, rows, op)
                reduce_arrays_(want, [rows[p] for p in range(n)], op)
                assert got.tobytes() == want.tobytes(), (n, numel)


def test_a_single_column_is_summed_pairwise_which_is_why_callers_pass_two():
    """numpy sums a one-column reduction pairwise: shm_ops takes the per-part path there."""
    rng = np.random.default_rng(1)
    differs = 0
    for _ in range(50):
        rows = _rows(rng, np.float32, 16, 1)
        got, want = np.empty(1, np.float32), np.empty(1, np.float32)
        reduce_rows_(got, rows, ReduceOp.SUM)
        reduce_arrays_(want, [rows[p] for p in range(16)], ReduceOp.SUM)
        differs += got.tobytes() != want.tobytes()
    assert differs
