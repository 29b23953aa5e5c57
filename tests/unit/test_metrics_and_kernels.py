import numpy as np
import pytest
import torch

from commrt.bench import metrics
from commrt.bench.runner import BenchSpec
from commrt.bench import report
from commrt.collectives.reduce_ops import ReduceOp, as_op, avg_part, combine_, copy_, finish_avg_, parse_op


@pytest.mark.parametrize("coll,n,factor", [("all_reduce", 2, 1.0), ("all_reduce", 4, 1.5),
                                           ("reduce_scatter", 4, 0.75), ("all_gather", 2, 0.5),
                                           ("all_to_all", 3, 2 / 3), ("broadcast", 8, 1.0),
                                           ("sendrecv", 4, 1.0), ("all_reduce", 1, 0.0)])
def test_bus_factors_follow_nccl_tests(coll, n, factor):
    assert metrics.bus_factor(coll, n) == pytest.approx(factor)
    assert metrics.busbw(coll, n, 2.0) == pytest.approx(2.0 * factor)


def test_algbw_and_sizes():
    assert metrics.algbw(1_000_000_000, 0.5) == pytest.approx(2.0)
    assert metrics.parse_size("4K") == 4096 and metrics.parse_size("64M") == 64 << 20
    assert metrics.parse_size("1G") == 1 << 30 and metrics.parse_size("100") == 100
    assert metrics.size_series(4096, 65536, 2) == [4096, 8192, 16384, 32768, 65536]
    with pytest.raises(ValueError):
        metrics.parse_size("4X")
    with pytest.raises(ValueError):
        metrics.size_series(10, 5, 2)


def test_count_wrong_detects_every_bad_element():
    want = torch.arange(100, dtype=torch.float32)
    got = want.clone()
    assert metrics.count_wrong(got, want) == 0
    got[[3, 50, 99]] += 1
    assert metrics.count_wrong(got, want) == 3
    assert metrics.count_wrong(torch.tensor([1, 2], dtype=torch.int8), torch.tensor([1, 3], dtype=torch.int8)) == 1
    assert metrics.count_wrong(torch.zeros(3), torch.zeros(4)) == 4


def test_table_has_nccl_tests_columns():
    spec = BenchSpec("all_reduce", ("zmq", "gloo"), 4096, 4096, 2, 1, 0, "float32", "sum", True)
    r = {"size": 4096, "count": 1024, "time_us": 100.0, "algbw": 0.04, "busbw": 0.04, "wrong": 0}
    rows = [{"zmq": r, "gloo": {**r, "time_us": 200.0, "wrong": 2}, "ceiling": 0.08}]
    text = report.table(spec, 2, rows)
    for col in ("size", "count", "type", "redop", "time", "algbw", "busbw", "#wrong", "ratio", "ceiling"):
        assert col in text
    assert " 2.00 " in text  # gloo took twice as long
    assert "gloo 2" in text  # wrong values counted
    doc = report.to_json(spec, 2, rows, "commrt bench ...")
    assert doc["avg_busbw"]["zmq"] == pytest.approx(0.04)


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
          torch.int32, torch.int64]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", list(ReduceOp))
def test_kernels_match_torch(dtype, op):
    g = torch.Generator().manual_seed(0)
    a = torch.randint(1, 5, (40000,), generator=g).to(dtype)
    b = torch.randint(1, 5, (40000,), generator=g).to(dtype)
    want = {ReduceOp.SUM: a + b, ReduceOp.AVG: a + b, ReduceOp.PRODUCT: a * b,
            ReduceOp.MIN: torch.minimum(a, b), ReduceOp.MAX: torch.maximum(a, b)}[op]
    acc = a.clone()
    combine_(acc, b, op)
    assert torch.equal(acc, want)
    out = torch.empty_like(a)
    copy_(out, acc)
    assert torch.equal(out, want)
    finish_avg_(out, 2)
    half = dtype in (torch.float16, torch.bfloat16)  # their AVG divides the parts, not the sum
    expect = want if half else want / 2 if dtype.is_floating_point else torch.div(want, 2, rounding_mode="floor")
    assert torch.equal(out, expect.to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_avg_divides_half_precision_parts_first(dtype):
    """float16 / bfloat16: each part / n before the sum, in place or into a copy; other dtypes and
    other ops: the part itself (their AVG divides the sum, finish_avg_)."""
    a = torch.full((40000,), 60000 if dtype == torch.float16 else 100, dtype=torch.float64).to(dtype)
    before = a.clone()
    half = dtype in (torch.float16, torch.bfloat16)
    copied = avg_part(a, ReduceOp.AVG, 4, copy=True)
    assert torch.equal(a, before) and (copied is not a) == half
    assert torch.equal(copied, (before.double() / 4).to(dtype) if half else before)
    assert avg_part(a, ReduceOp.SUM, 4) is a and avg_part(a, ReduceOp.AVG, 1) is a
    assert avg_part(a, ReduceOp.AVG, 4) is a and torch.equal(a, copied)
    if dtype != torch.bfloat16:  # numpy's own arrays (no bfloat16 there) take the same rule
        arr = before.numpy().copy()
        assert avg_part(arr, ReduceOp.AVG, 4) is arr and np.array_equal(arr, copied.numpy())


def test_torch_ops_that_are_not_ours_are_named_in_the_error():
    """torch's PREMUL_SUM (a ReduceOp object wrapping the factor) was refused as "unknown reduce
    op 'ReduceOp object at 0x...'"; it and the bitwise ops are named, with what to do instead."""
    import torch.distributed as dist
    with pytest.raises(ValueError, match="PREMUL_SUM is not supported; scale the tensor and use SUM"):
        as_op(dist._make_nccl_premul_sum(2.0))
    for op in (dist.ReduceOp.BAND, "bxor"):
        with pytest.raises(ValueError, match="(BAND|BXOR) is not supported; bitwise"):
            as_op(op)
    assert as_op(dist.ReduceOp.AVG) is ReduceOp.AVG and as_op(dist.ReduceOp.PRODUCT) is ReduceOp.PRODUCT


def test_parse_op_accepts_names_and_torch_spelling():
    assert parse_op("sum") is ReduceOp.SUM and parse_op("prod") is ReduceOp.PRODUCT
    with pytest.raises(ValueError, match="valid"):
        parse_op("median")
