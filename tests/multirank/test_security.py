"""Authentication: with CURVE, strangers (no key, an unknown key, plaintext, a silent connection,
a genuine key claiming another rank) get nothing in and the job's results stay exact."""
import re

import pytest

from tests.multirank.harness import run_ranks

CURVE = {"COMMRT_COMM_BACKEND": "zmq", "COMMRT_SECURITY_MODE": "curve", "COMMRT_COMM_TIMEOUT_S": "20"}


@pytest.mark.parametrize("kind", ["plaintext", "unknown_key", "raw_tcp", "silent_tcp", "other_rank"])
def test_strangers_are_refused(kind):
    _, out = run_ranks(3, "strangers", kind, env=CURVE, timeout_s=60)
    results = re.findall(r"\[rank (\d)\] RESULT (\w+) dropped=(\d+)", out)
    assert sorted(r for r, _, _ in results) == ["0", "1", "2"] and all(v == "exact" for _, v, _ in results), out
    dropped = {r: int(d) for r, _, d in results}
    if kind == "other_rank":  # authenticated, so it got as far as the sender check, and no further
        assert dropped["1"] == 1 and "came over rank2's key" in out, out
    else:  # refused during the handshake: never even read
        assert dropped["1"] == 0, out
    if kind == "unknown_key":
        assert "refused a connection with an unknown CURVE key" in out, out


def test_plaintext_job_cannot_join_a_curve_job():
    """Half the ranks without keys: rendezvous with rank 0's store fails, with a typed error."""
    _, out = run_ranks(2, "failures", "curve_mix", env={**CURVE, "COMMRT_COMM_TIMEOUT_S": "3"},
                       timeout_s=60, expect_fail=False)
    assert "CAUGHT RendezvousError" in out and "did not answer" in out, out
