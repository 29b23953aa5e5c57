"""Divergent programs, dead peers and broken rendezvous become typed errors, never hangs."""
import re

import pytest

from tests.multirank.harness import run_ranks

ENV = {"COMMRT_COMM_BACKEND": "zmq", "COMMRT_COMM_TIMEOUT_S": "30"}  # generous: see programs/failures.py


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


@pytest.mark.parametrize("mode,n", [("root_broadcast", 2), ("root_reduce", 3)])
def test_ranks_that_disagree_about_the_root_fail_at_once_over_tcp(mode, n):
    """On TCP a non-root rank only hears from its parent: ranks that each took another for the
    root waited out the deadline (30 s here) and blamed a live rank as lost (ops._agree_on_root)."""
    _, out = run_ranks(n, "failures", mode, env={**ENV, "COMMRT_COMM_INTRA_NODE": "tcp"}, timeout_s=40)
    errors = caught(out)
    assert len(errors) == n and all(kind == "CollectiveMismatch" and "root=" in msg for kind, msg in errors), out


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
        assert float(seconds) < 30, out  # through the dropped connection, not the 30 s timeout


def test_missing_rank_is_listed(tmp_path):
    _, out = run_ranks(2, "failures", "missing", env={**ENV, "COMMRT_TEST_START_DIR": str(tmp_path)}, timeout_s=60)
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


def test_version_mismatch_names_the_rank():
    _, out = run_ranks(2, "failures", "version", env=ENV, timeout_s=60)
    errors = caught(out)
    assert len(errors) == 2 and all(k == "RendezvousError" for k, _ in errors), out
    assert all("wire protocol version" in m and "rank 1" in m and "rank 0" in m for _, m in errors), out


def test_world_size_mismatch_names_the_rank(tmp_path):
    _, out = run_ranks(2, "failures", "world_size", env={**ENV, "COMMRT_TEST_START_DIR": str(tmp_path)},
                       timeout_s=60)
    errors = caught(out)
    assert len(errors) == 2 and all(k == "RendezvousError" for k, _ in errors), out
    assert re.search(r"\[rank 0\] CAUGHT RendezvousError: rank 1 .* has world size 3, rank 0 has 2", out), out


def test_nccl_failing_on_one_rank_falls_back_on_every_rank():
    """README: if NCCL's initialisation fails on any rank, every rank falls back to zmq with a
    warning naming the cause (the ranks where it worked tear their process group down)."""
    _, out = run_ranks(2, "failures", "nccl_half", env=ENV, timeout_s=60)
    for r in range(2):
        assert f"[rank {r}] OK rank {r} fell back to zmq" in out, out
        assert re.search(rf"\[rank {r}\] .*NCCL initialisation failed \(rank 1: RuntimeError: simulated NCCL "
                         r"failure on rank 1.*falling back to zmq", out), out
