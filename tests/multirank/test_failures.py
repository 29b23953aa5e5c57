"""Divergent programs, dead peers and broken rendezvous become typed errors, never hangs."""
import re

import pytest

from tests.multirank.harness import run_ranks

ENV = {"COMMRT_COMM_BACKEND": "zmq", "COMMRT_COMM_TIMEOUT_S": "3"}


def caught(out: str) -> list[str]:
    return re.findall(r"CAUGHT (\w+): (.*)", out)


@pytest.mark.parametrize("mode", ["dtype", "count", "op", "skip"])
def test_collective_mismatch(mode):
    # a skipped collective followed by one that looks the same needs the call-site check
    env = {**ENV, "COMMRT_COMM_CHECK_CALL_SITES": "1"} if mode == "skip" else ENV
    _, out = run_ranks(2, "failures", mode, env=env, timeout_s=40)
    errors = caught(out)
    assert len(errors) == 2, out
    for kind, msg in errors:
        assert kind == "CollectiveMismatch", out
        assert "rank 0" in msg and "rank 1" in msg, msg


def test_group_refuses_after_failure():
    _, out = run_ranks(2, "failures", "after_error", env=ENV, timeout_s=40)
    assert [k for k, _ in caught(out)] == ["CommError", "CommError"], out
    assert "unusable after an earlier failure" in out


def test_dead_peer_is_named():
    _, out = run_ranks(3, "failures", "dead", env=ENV, timeout_s=40)
    errors = caught(out)
    assert len(errors) == 2 and all(k == "PeerLost" for k, _ in errors), out
    # the survivors wait on different peers, but every one names the dead rank 2
    assert all("lost peer rank 2" in m for _, m in errors), out
    for seconds in re.findall(r"detected after ([\d.]+)s", out):
        assert float(seconds) < 3 + 2, out


def test_missing_rank_is_listed():
    _, out = run_ranks(2, "failures", "missing", env=ENV, timeout_s=40)
    errors = caught(out)
    assert len(errors) == 2 and all(k == "RendezvousError" for k, _ in errors), out
    assert all("1 of 3 ranks never joined" in m and "missing: 2" in m for _, m in errors), out


def test_duplicate_rank_names_both():
    _, out = run_ranks(3, "failures", "duplicate", env=ENV, timeout_s=40)
    errors = caught(out)
    assert len(errors) == 3 and all(k == "RendezvousError" for k, _ in errors), out
    assert all("duplicate rank 1" in m and m.count("pid") == 2 for _, m in errors), out


def test_config_mismatch():
    _, out = run_ranks(2, "failures", "config", env=ENV, timeout_s=40)
    errors = caught(out)
    assert len(errors) == 2 and all("config digest" in m for _, m in errors), out
