"""``commrt bench --algo``: one column per pinned schedule, refused names listed with the valid."""
import pytest

from commrt.bench.runner import _variant_config, algorithm_variant, backend_variant
from commrt.cli.bench_cmd import check_backends, with_algorithms
from commrt.runtime.config import Config


def test_algo_columns_replace_the_zmq_column():
    assert with_algorithms(("zmq", "gloo"), "all_reduce", "ring,rabenseifner") == ("gloo", "zmq:ring", "zmq:rabenseifner")
    assert with_algorithms(("zmq@1M",), "all_reduce", "all") == tuple(
        f"zmq@1M:{a}" for a in ("rabenseifner", "recursive_doubling", "ring"))


@pytest.mark.parametrize("collective, algo", [("all_reduce", "bruck"), ("reduce_scatter", "ring"), ("all_gather", "")])
def test_algo_names_are_checked_before_launch(collective, algo):
    with pytest.raises(SystemExit, match="valid:"):
        with_algorithms(("zmq",), collective, algo)


def test_an_algo_column_pins_the_schedule_over_tcp():
    assert backend_variant("zmq@1M:bruck") == ("zmq", 1 << 20) and algorithm_variant("zmq@1M:bruck") == "bruck"
    assert algorithm_variant("zmq+hier") is None
    cfg = _variant_config(Config(), "zmq@1M:bruck", "all_gather")
    assert (cfg.comm.algorithms, cfg.comm.intra_node, cfg.comm.chunk_bytes) == ("all_gather=bruck", "tcp", 1 << 20)
    assert _variant_config(Config(), "gloo", "all_gather").comm.algorithms == ""


@pytest.mark.parametrize("backends, want", [
    (("zmq+hier",), ("zmq+hier", "zmq:ring")),
    (("zmq+hier", "zmq"), ("zmq+hier", "zmq:ring")),
    (("zmq+hier", "zmq@1M"), ("zmq+hier", "zmq@1M:ring")),
])
def test_an_algo_column_pins_its_schedule_whatever_variants_the_backend_list_holds(backends, want):
    # --backend zmq+hier --algo ring made the column 'zmq+hier:ring': neither '+hier' (the name no
    # longer ends with it) nor the ring (algorithm_variant reads before the '+'): plain zmq, the
    # table's schedule, under a name that claimed both
    cols = with_algorithms(backends, "all_reduce", "ring")
    assert cols == want
    pinned = [c for c in cols if ":" in c]
    assert [algorithm_variant(c) for c in pinned] == ["ring"]


@pytest.mark.parametrize("name, says", [("gloo:ring", "only zmq"), ("nccl:ring", "only zmq"),
                                        ("zmq:bogus", "valid for all_reduce"), ("zmq@1M:bruck", "valid for all_reduce")])
def test_a_schedule_named_in_backend_is_checked_before_launch(name, says):
    # 'gloo:ring' printed gloo's figures under a name claiming the ring (the pin is [comm]'s,
    # which gloo never reads); 'zmq:bogus' failed on every rank after the start-up
    with pytest.raises(SystemExit, match=says):
        check_backends((name,), "all_reduce")


def test_a_schedule_the_collective_has_passes():
    check_backends(("zmq:ring", "zmq@1M:rabenseifner", "gloo"), "all_reduce")
    check_backends(("zmq:bruck",), "all_gather")
