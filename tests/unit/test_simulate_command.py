"""``commrt estimate --simulate``: parses, prints a table and JSON, rejects unknown algorithms."""
import argparse
import json

import pytest

from commrt.plan import command
from commrt.runtime.errors import ConfigError


def _args(*argv):
    p = argparse.ArgumentParser()
    command.add_parser(p.add_subparsers()).set_defaults()
    return p.parse_args(["estimate", "--simulate", *argv])


def test_table_names_every_algorithm_and_the_pick():
    text = command.render(_args("--worlds", "8,12", "--sizes", "4K,64M")).text
    lines = text.splitlines()
    assert "recursive_doubling us" in lines[1] and "ring us" in lines[1] and len(lines) == 6
    assert lines[2].split()[-1] == "recursive_doubling" and lines[3].split()[-1] == "ring"


def test_json_reports_time_and_links():
    out = json.loads(command.render(_args("--json", "--worlds", "16", "--sizes", "64K",
                                          "--algorithms", "ring", "--per-node", "8")).text)
    (r,) = out["results"]
    assert r["algorithm"] == "ring" and r["seconds"] > 0 and r["links"]["nic_up"]["links"] == 2


def test_unknown_algorithm_and_missing_params():
    with pytest.raises(ConfigError, match="valid: \\['rabenseifner'"):
        command.render(_args("--algorithms", "tree"))
    args = _args()
    args.simulate = False
    with pytest.raises(ConfigError, match="needs --params"):
        command.render(args)


def test_the_cpu_term_from_the_command_line():
    base = ["--json", "--worlds", "2", "--per-node", "2", "--sizes", "4K", "--algorithms", "recursive_doubling",
            "--intra-latency", "0", "--intra-bw", "1000000GB/s"]
    (off,) = json.loads(command.render(_args(*base)).text)["results"]
    (own,) = json.loads(command.render(_args(*base, "--cpu-msg", "1e-3")).text)["results"]
    (shared,) = json.loads(command.render(_args(*base, "--cpu-msg", "1e-3", "--cores", "1")).text)["results"]
    assert off["seconds"] < 1e-6  # the default stays without CPU
    assert own["seconds"] == pytest.approx(2e-3) and shared["seconds"] == pytest.approx(4e-3)


def test_sharing_picks_the_link_discipline():
    # 2 leaves of 2 nodes (one rank each): doubling's cross-leaf step shares leaf 0's uplink
    argv = ("--json", "--worlds", "4", "--sizes", "1M", "--algorithms", "recursive_doubling", "--per-node", "1",
            "--nodes-per-leaf", "2", "--inter-bw", "1GB/s")
    fcfs, fair = (json.loads(command.render(_args(*argv, *extra)).text) for extra in ((), ("--sharing", "fair")))
    assert fcfs["network"]["sharing"] == "fcfs" and fair["network"]["sharing"] == "fair"
    assert fair["results"][0]["seconds"] < fcfs["results"][0]["seconds"] * 0.8


@pytest.mark.parametrize("argv", [
    ("--worlds", "0"), ("--nodes-per-leaf", "0"), ("--oversubscription", "0"), ("--oversubscription", "inf"),
    ("--oversubscription", "nan"), ("--cpu-msg", "-1"), ("--intra-latency=-1e-6",), ("--inter-latency", "nan"),
    ("--reduce-bw", "1.2.3"), ("--intra-bw", "."), ("--per-node", "0")])
def test_a_bad_network_is_a_config_error_not_a_traceback(argv):
    """Found by running each option at 0, negative, inf, nan: a ValueError traceback from
    Network, a ZeroDivisionError in the replay (infinite oversubscription: a 0 B/s spine), or a
    negative latency / nan ratio simulated as if valid."""
    leaf = () if argv[0] == "--nodes-per-leaf" else ("--nodes-per-leaf", "2")  # a spine to cross
    with pytest.raises(ConfigError):
        command.render(_args("--nodes", "4", "--sizes", "64K", *leaf, *argv))


def test_a_world_beyond_the_replay_limit_is_a_config_error():
    """reduce/ring at 2000 ranks (2000^2 rank-steps, not uniform): a ValueError traceback from
    the command line before; now the one-line error naming --algorithms."""
    with pytest.raises(ConfigError, match="--algorithms"):
        command.render(_args("--collective", "reduce", "--algorithms", "ring", "--worlds", "2000", "--sizes", "4K"))


def test_a_log_step_schedule_beyond_the_replay_limit_is_refused_at_once():
    """recursive doubling at 1,000,000 ranks: only the ring and chain had a limit, so this
    built and replayed ~20 million rank-steps (100,000 ranks took 39 s; a million, minutes and
    gigabytes) before answering; now a one-line ConfigError before any schedule is built."""
    with pytest.raises(ConfigError, match="rank-steps"):  # without the limit: the suite's 120 s timeout
        command.render(_args("--algorithms", "recursive_doubling", "--worlds", "1000000", "--sizes", "4K"))


@pytest.mark.parametrize("size", ["2", "6"])
def test_a_size_that_is_not_whole_float32_elements_is_refused(size):
    """The replay moves float32 elements (nbytes // 4): --sizes 2 was simulated as an op of 0
    elements and 6 as 4 B, each printed under the size asked for."""
    with pytest.raises(ConfigError, match="multiple of 4"):
        command.render(_args("--sizes", size))


def test_a_large_size_over_a_log_step_schedule_is_replayed_not_refused():
    # the limit counted the log-step schedules' rank-steps once per 4 MiB piece: recursive
    # doubling of 1 GiB at 1,024 ranks (10 steps a rank, 10,240 in all) was refused as
    # "about 5242880 rank-steps"; only the chain's steps grow with the pieces
    text = command.render(_args("--algorithms", "recursive_doubling", "--worlds", "1024", "--per-node", "8",
                                "--sizes", "1G")).text
    assert "1073741824" in text
    with pytest.raises(ConfigError, match="rank-steps"):  # the chain's 4,096 pieces at 1,024 ranks: 4 M steps
        command.render(_args("--collective", "broadcast", "--algorithms", "chain", "--worlds", "1024",
                             "--sizes", "16G"))
