"""The cuts of the pipelined two-hop quantized all_reduce (pure logic)."""
from __future__ import annotations

import pytest

from commrt.quant.hierarchical import piece_bounds


@pytest.mark.parametrize("n", [0, 1, 7, 1023, 1024, 4096, 20000, 70001, 1 << 22])
@pytest.mark.parametrize("unit,pieces,min_piece", [(1024, 8, 4096), (12, 3, 100), (2, 8, 1 << 20)])
def test_pieces_cover_the_range_in_whole_units(n, unit, pieces, min_piece):
    cuts = piece_bounds(n, unit, pieces, min_piece)
    assert cuts[0][0] == 0 and cuts[-1][1] == n
    assert all(b == c for (_, b), (c, _) in zip(cuts, cuts[1:]))
    assert all((b - a) % unit == 0 for a, b in cuts[:-1])  # only the last may be short
    assert len(cuts) <= pieces and (len(cuts) == 1 or n >= min_piece)


def test_a_small_payload_is_one_piece_and_a_large_one_many():
    assert piece_bounds(70001, 1024, 8, 1 << 20) == [(0, 70001)]
    assert len(piece_bounds(1 << 24, 1024, 8, 1 << 20)) == 8
