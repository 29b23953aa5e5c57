"""``commrt bench``'s fill pattern (bench/cases.pattern): every rank's differs from every other's,
so a misrouted piece is caught at any world size, and sums stay exact in every dtype."""
import pytest
import torch

from commrt.bench.cases import pattern, reference
from commrt.collectives.reduce_ops import ReduceOp

WORLD = 16384
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int32,
          torch.int64]


def _all_told_apart(dtype, world: int, window: int) -> None:
    every = torch.stack([pattern(40, r, dtype, ReduceOp.SUM) for r in range(world)]).long() + 8
    for start in range(0, 40 - window + 1, 3):
        key = torch.zeros(world, dtype=torch.int64)
        for k in range(window):  # each row of the window as one number (symbols are 0..16)
            key = key * 17 + every[:, start + k]
        assert len(torch.unique(key)) == world, start
    # one element tells apart the ranks below the base (as the old pattern did those below 17)
    assert all(len(torch.unique(every[:7, k])) == 7 for k in range(40))


@pytest.mark.parametrize("dtype, window", [(torch.int8, 3), (torch.uint8, 4)])
def test_any_few_consecutive_elements_tell_every_rank_apart(dtype, window):
    """The pattern was the same for ranks 17 apart: rank 20's piece in rank 3's place passed.
    Now D consecutive elements tell apart every two ranks below p**D (17**3, 7**4 > 2000)."""
    _all_told_apart(dtype, 2000, window)


@pytest.mark.slow
@pytest.mark.parametrize("dtype, window", [(torch.int8, 4), (torch.uint8, 5)])
def test_sixteen_thousand_ranks_are_told_apart(dtype, window):
    _all_told_apart(dtype, WORLD, window)


@pytest.mark.parametrize("dtype", DTYPES)
def test_small_values_so_sums_stay_exact(dtype):
    """|v| <= 8 as before: a float16 sum of 256 ranks (|sum| <= 2048) and a bfloat16 sum of 32 are
    exact in any order; integers wrap the same way in the reference and the reduction."""
    world = {torch.bfloat16: 32}.get(dtype, 256)
    parts = [pattern(100, r, dtype, ReduceOp.SUM) for r in range(world)]
    assert all(int(p.abs().max()) <= 8 for p in parts) and all(int(p.min()) >= 0 for p in parts if dtype == torch.uint8)
    for order in (range(world), reversed(range(world))):
        acc = torch.zeros(100, dtype=dtype)
        for r in order:
            acc += parts[r]
        assert torch.equal(acc, reference(parts, ReduceOp.SUM))
