"""The CUDA staging plan (backends/staging.py) as pure functions, without a GPU: which element
ranges become pieces, and that the step order overlaps each exchange with the next piece's
device-to-host copy and the previous piece's host-to-device copy. The staged all_reduce itself
runs in tests/multirank/test_cuda.py and tests/gpu/staging_timing.py (``cuda``)."""
import pytest

from commrt.backends.staging import TARGET_PIECES, piece_bounds, schedule

MiB = 1 << 20


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
@pytest.mark.parametrize("nbytes", [0, 1, 8, MiB - 8, MiB, 4 * MiB + 8, 16 * MiB, 64 * MiB, 1 << 30])
def test_pieces_cover_the_tensor_in_order_within_the_size_limits(nbytes, itemsize):
    numel = nbytes // itemsize
    bounds = piece_bounds(numel, itemsize, 16 * MiB)
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a1 == b0 for (_, b0), (a1, _) in zip(bounds, bounds[1:]))  # contiguous, no overlap
    assert all(b - a <= 16 * MiB // itemsize for a, b in bounds)
    if numel:
        assert all(b > a for a, b in bounds)
        assert all((b - a) * itemsize >= MiB for a, b in bounds[:-1])  # only the last may be short


def test_piece_counts_pipeline_from_a_few_mib_and_grow_past_the_largest_piece():
    count = lambda nbytes: len(piece_bounds(nbytes // 4, 4, 16 * MiB))
    assert count(MiB) == 1  # one piece: each piece is a collective with its own latency
    assert count(4 * MiB) == TARGET_PIECES
    assert count(16 * MiB) == TARGET_PIECES
    assert count(64 * MiB) == TARGET_PIECES
    assert count(1 << 30) == 64  # capped at 16 MiB a piece
    assert len(piece_bounds(MiB // 4, 4, 16 * MiB, min_piece_bytes=256 << 10)) == TARGET_PIECES


@pytest.mark.parametrize("pieces", [1, 2, 3, 4, 9])
def test_each_exchange_overlaps_the_next_d2h_and_the_previous_h2d(pieces):
    events = []  # the order the host issues things in, after piece 0's D2H in the constructor
    for d2h, ex, h2d in schedule(pieces):
        events += [("d2h", d2h)] if d2h is not None else []
        events += [("ex", ex), ("h2d", h2d)]
    events = [("d2h", 0)] + events
    for kind in ("d2h", "ex", "h2d"):
        assert [i for k, i in events if k == kind] == list(range(pieces)), kind  # each once, in order
    at = {e: n for n, e in enumerate(events)}
    for k in range(pieces):
        assert at[("d2h", k)] < at[("ex", k)] < at[("h2d", k)]  # data dependencies
        if k + 1 < pieces:  # queued before exchange k, so it runs during it
            assert at[("d2h", k + 1)] < at[("ex", k)]
            assert at[("ex", k + 1)] > at[("h2d", k)]  # H2D of k runs during exchange k + 1
