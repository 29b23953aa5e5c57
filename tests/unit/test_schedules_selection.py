"""The selection table (issue 32.1): defaults cover every collective at every size, overrides
go first, and a bad override names what is valid."""
import pytest

from commrt.collectives import selection as sel
from commrt.collectives.schedules import ALGORITHMS
from commrt.runtime.errors import ConfigError


@pytest.mark.parametrize("collective", sorted(ALGORITHMS))
def test_defaults_cover_every_size_and_world(collective):
    for world in (1, 2, 3, 8, 1000, 16384):
        for nbytes in (0, 1, 4096, 65536, 1 << 20, 1 << 34):
            assert sel.choose(collective, nbytes, world) in ALGORITHMS[collective]


def test_defaults_go_from_latency_to_bandwidth_algorithms():
    assert sel.choose("all_reduce", 4096, 1024) == "recursive_doubling"
    assert sel.choose("all_reduce", 128 << 10, 1024) == "rabenseifner"
    assert sel.choose("all_reduce", 64 << 20, 1024) == "ring"
    assert sel.choose("broadcast", 4096, 64) == "binomial"
    assert sel.choose("all_gather", 4096, 64) == "bruck"
    # two ranks: one whole-buffer exchange beats two halves up to 1 MiB (measured, loopback)
    assert [sel.choose("all_reduce", n, 2) for n in (4096, 512 << 10, 1 << 20)] == \
        ["recursive_doubling", "recursive_doubling", "rabenseifner"]
    assert sel.choose("all_reduce", 512 << 10, 3) == "rabenseifner"


def test_overrides_pin_an_algorithm_for_a_range():
    table = sel.table_from({"all_reduce": [{"algorithm": "ring", "max_bytes": 1024, "min_world": 4}],
                            "all_gather": "ring"})
    assert sel.choose("all_reduce", 512, 8, table) == "ring"
    assert sel.choose("all_reduce", 512, 2, table) == "recursive_doubling"   # outside the world range
    assert sel.choose("all_reduce", 2048, 8, table) == "recursive_doubling"  # outside the byte range
    assert [sel.choose("all_reduce", b, w, table) for b, w in ((1023, 4), (1024, 4), (0, 3))] == \
        ["ring", "recursive_doubling", "recursive_doubling"]  # max_bytes excluded, min_world included
    assert sel.choose("all_gather", 1, 8, table) == "ring"
    assert "ring" in sel.format_table(table).splitlines()[0]


@pytest.mark.parametrize("overrides,says", [
    ({"allreduce": "ring"}, "valid: ['all_gather', 'all_reduce'"),
    ({"all_reduce": "tree"}, "valid: ['rabenseifner', 'recursive_doubling', 'ring']"),
    ({"all_reduce": [{"algorithm": "ring", "max_size": 3}]}, "unknown keys ['max_size']"),
    ({"all_reduce": [{"algorithm": "ring", "max_bytes": -1}]}, "non-negative"),
    ({"all_reduce": 3}, "expected a name or a table"),
    # a range nothing matches (max_bytes is exclusive): pinned, yet silently never run
    ({"all_reduce": [{"algorithm": "ring", "min_bytes": 4096, "max_bytes": 1024}]}, "is empty"),
    ({"all_reduce": [{"algorithm": "ring", "min_bytes": 1024, "max_bytes": 1024}]}, "is empty"),
    ({"all_reduce": [{"algorithm": "ring", "min_world": 5, "max_world": 4}]}, "is empty"),
])
def test_bad_overrides_name_what_is_valid(overrides, says):
    with pytest.raises(ConfigError, match=None) as err:
        sel.table_from(overrides)
    assert says in str(err.value)


def test_a_table_with_a_gap_says_so():
    with pytest.raises(ConfigError, match="no algorithm for all_reduce"):
        sel.choose("all_reduce", 1 << 20, 8, (sel.Rule("all_reduce", "ring", max_bytes=1024),))


def test_config_vocabulary_is_the_schedules():
    """[comm] algorithms is checked below the collectives layer: its list must be ALGORITHMS'."""
    from commrt.runtime.config.comm import ALGORITHM_CHOICES
    assert ALGORITHM_CHOICES == {c: tuple(sorted(a)) for c, a in ALGORITHMS.items()}


def test_comm_algorithms_pins_through_the_table():
    from commrt.runtime.config import load_config
    from commrt.runtime.config.comm import parse_algorithms
    cfg = load_config(environ={"COMMRT_COMM_ALGORITHMS": "all_reduce=ring@1MiB-, all_reduce=rabenseifner@-4KiB,"
                                                        " broadcast=binomial"})
    table = sel.table_from(parse_algorithms(cfg.comm.algorithms))
    assert sel.choose("all_reduce", 1 << 20, 8, table) == "ring"
    assert sel.choose("all_reduce", 100, 8, table) == "rabenseifner"
    assert sel.choose("all_reduce", 8 << 10, 8, table) == "recursive_doubling"  # the default between
    assert sel.choose("broadcast", 1 << 30, 8, table) == "binomial"
    assert parse_algorithms("") == {} and load_config(environ={}).comm.algorithms == ""


@pytest.mark.parametrize("text, says", [
    ("all_reduce=tree", "valid for all_reduce: ['rabenseifner', 'recursive_doubling', 'ring']"),
    ("allreduce=ring", "collectives: ['all_reduce', 'broadcast'"),
    ("all_reduce", "expected collective=algorithm"),
    ("all_reduce=ring@1MiB", "MIN-MAX"),
    ("all_reduce=ring@1XB-", "expected an integer with an optional unit"),
    ("all_reduce=ring@1MiB-1KiB", "is empty"),
    ("all_reduce=ring@1KiB-1KiB", "is empty"),
])
def test_bad_comm_algorithms_fail_at_load_naming_what_is_valid(text, says):
    from commrt.runtime.config import load_config
    with pytest.raises(ConfigError, match="COMMRT_COMM_ALGORITHMS") as info:
        load_config(environ={"COMMRT_COMM_ALGORITHMS": text})
    assert says in str(info.value)
