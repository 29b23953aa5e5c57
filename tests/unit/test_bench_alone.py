"""The op-by-op bench mode's arithmetic (bench/alone.py) and its columns: pure, no processes."""
import pytest

from commrt.bench import alone, metrics, report
from commrt.bench.runner import BenchSpec


def test_parse_mode():
    assert alone.parse_mode("both") == (True, True)
    assert alone.parse_mode("back-to-back") == (True, False)
    assert alone.parse_mode("alone") == (False, True)
    with pytest.raises(ValueError, match="valid"):
        alone.parse_mode("loop")


def test_a_sample_takes_the_slowest_rank():
    per_rank = [[1.0, 5.0, 2.0], [3.0, 4.0, 2.5]]
    assert alone.slowest_per_sample(per_rank) == [3.0, 5.0, 2.5]
    with pytest.raises(ValueError):
        alone.slowest_per_sample([[1.0], [1.0, 2.0]])


def test_summary_is_the_median_of_slowest_samples():
    s = alone.summarize([0.004, 0.001, 0.003, 0.002, 0.100], "all_reduce", 2, 4_000_000)
    assert s["time_us"] == pytest.approx(3000.0)  # one 100 ms outlier does not move the median
    assert s["samples"] == 5 and s["p10_us"] == pytest.approx(1000.0) and s["p90_us"] == pytest.approx(100_000.0)
    assert s["algbw"] == pytest.approx(4e6 / 0.003 / 1e9)
    assert s["busbw"] == pytest.approx(s["algbw"] * metrics.bus_factor("all_reduce", 2))
    with pytest.raises(ValueError):
        alone.summarize([], "all_reduce", 2, 1)


def test_backends_alternate_sample_by_sample():
    order = []
    got = alone.interleave(3, ["zmq", "gloo"], lambda name: order.append(name) or len(order))
    assert order == ["zmq", "gloo"] * 3
    assert got == {"zmq": [1, 3, 5], "gloo": [2, 4, 6]}


@pytest.mark.parametrize("coll,want", [("all_reduce", 2 / (1 / 4 + 1 / 6)), ("reduce_scatter", 4.0),
                                       ("all_gather", 6.0), ("sendrecv", 6.0)])
def test_memory_ceiling_per_collective(coll, want):
    assert metrics.shm_busbw_ceiling(coll, memcpy_gbs=6.0, reduce_gbs=4.0) == pytest.approx(want)
    assert metrics.shm_busbw_ceiling(coll, 0.0, 4.0) == 0.0


def _row(t: float, alone_t: float, path: str = "tcp") -> dict:
    return {"size": 4096, "count": 1024, "time_us": t, "algbw": 0.04, "busbw": 0.04, "wrong": 0, "path": path,
            "alone": {"time_us": alone_t, "p10_us": alone_t, "p90_us": alone_t, "algbw": 0.02, "busbw": 0.02,
                      "samples": 3}}


def test_table_shows_alone_beside_back_to_back_and_each_path_ceiling():
    spec = BenchSpec("all_reduce", ("zmq", "gloo"), 4096, 4096, 2, 3, 0, "float32", "sum", True, "both")
    rows = [{"zmq": _row(100.0, 300.0, "shm"), "gloo": _row(200.0, 900.0), "ceiling": 0.08,
             "memory": {"memcpy": 2.0, "reduce": 1.0, "busbw": 0.04}}]
    text = report.table(spec, 2, rows)
    assert " 2.00 " in text and " 3.00 " in text  # back-to-back ratio, then the op-by-op one
    assert "alone" in text and "mem-ceil" in text and "op by op" in text
    line = [ln for ln in text.splitlines() if ln.strip().startswith("4096")][0]
    assert line.split()[-2:] == ["50.0", "25.0"]  # zmq against memory (0.02/0.04), gloo against TCP
    doc = report.to_json(spec, 2, rows, "commrt bench ...")
    assert doc["avg_busbw_alone"] == {"zmq": pytest.approx(0.02), "gloo": pytest.approx(0.02)}
    assert doc["mode"] == "both"


def test_table_of_alone_only_rows():
    spec = BenchSpec("all_reduce", ("zmq", "gloo"), 4096, 4096, 2, 3, 0, "float32", "sum", False, "alone")
    strip = lambda r: {k: v for k, v in r.items() if k in ("size", "count", "wrong", "alone")}
    text = report.table(spec, 2, [{"zmq": strip(_row(0, 300.0)), "gloo": strip(_row(0, 600.0))}])
    assert " 2.00" in text and "Avg bus bandwidth    :" not in text


def test_backend_variants_name_a_piece_size():
    from commrt.bench.runner import backend_variant
    assert backend_variant("zmq") == ("zmq", None)
    assert backend_variant("zmq+hier") == ("zmq", None)
    assert backend_variant("zmq@1M") == ("zmq", 1 << 20)
    assert backend_variant("gloo") == ("gloo", None)
    with pytest.raises(ValueError):
        backend_variant("zmq@lots")


def test_percentiles_are_nearest_rank():
    """Of 10 samples p90 is the 9th fastest and p10 the fastest; int(q * n) picked one rank
    higher (the slowest, the second fastest). 20 samples (the default -n): the 18th and 2nd."""
    s = alone.summarize([i * 1e-6 for i in range(1, 11)], "all_reduce", 2, 4096)
    assert (s["p10_us"], s["p90_us"]) == (pytest.approx(1.0), pytest.approx(9.0))
    s = alone.summarize([i * 1e-6 for i in range(1, 21)], "all_reduce", 2, 4096)
    assert (s["p10_us"], s["p90_us"]) == (pytest.approx(2.0), pytest.approx(18.0))
