"""Authentication: in the default secret mode and with CURVE, strangers (plaintext, a wrong
secret, no key, an unknown key, raw bytes, a silent connection, a genuine key claiming another
rank) get nothing in and the job's results stay exact; with mode none the same forgery gets in."""
import re

import pytest

from tests.multirank.harness import run_ranks

# the strangers forge messages on the collective sockets: keep the payloads there (intra_node tcp;
# on shared memory the sockets carry only liveness and ABORT notices)
CURVE = {"COMMRT_COMM_BACKEND": "zmq", "COMMRT_SECURITY_MODE": "curve", "COMMRT_COMM_TIMEOUT_S": "20",
         "COMMRT_COMM_INTRA_NODE": "tcp"}
DEFAULT = {"COMMRT_COMM_BACKEND": "zmq", "COMMRT_COMM_TIMEOUT_S": "20",
           "COMMRT_COMM_INTRA_NODE": "tcp"}  # mode secret, launch's secret


def _results(out: str) -> dict:
    results = re.findall(r"\[rank (\d)\] RESULT (\w+) dropped=(\d+)", out)
    assert sorted(r for r, _, _ in results) == ["0", "1", "2"] and all(v == "exact" for _, v, _ in results), out
    return {r: int(d) for r, _, d in results}


@pytest.mark.parametrize("kind", ["plaintext", "wrong_secret", "raw_tcp"])
def test_strangers_are_refused_in_the_default_mode(kind):
    _, out = run_ranks(3, "strangers", kind, env=DEFAULT, timeout_s=60)
    assert _results(out)["1"] == 0, out  # refused during the handshake: never even read
    if kind == "wrong_secret":
        assert "claiming to be 'rank0': wrong job secret" in out, out


def test_without_authentication_the_same_forgery_gets_in():
    """mode none: the plaintext stranger's forged message is taken as rank 0's part, so the job
    goes wrong (a wrong sum, or the mismatch its leftover causes): the tests above can fail."""
    _, out = run_ranks(3, "strangers", "plaintext", env={**DEFAULT, "COMMRT_SECURITY_MODE": "none"},
                       timeout_s=60, expect_fail=True)
    assert "[rank 1] RESULT exact" not in out, out
    assert "[rank 1] RESULT WRONG" in out or "CollectiveMismatch" in out, out


@pytest.mark.parametrize("kind", ["plaintext", "unknown_key", "raw_tcp", "silent_tcp", "other_rank"])
def test_strangers_are_refused(kind):
    _, out = run_ranks(3, "strangers", kind, env=CURVE, timeout_s=60)
    dropped = _results(out)
    if kind == "other_rank":  # authenticated, so it got as far as the sender check, and no further
        assert dropped["1"] == 1 and "came over rank2's key" in out, out
    else:  # refused during the handshake: never even read
        assert dropped["1"] == 0, out
    if kind == "unknown_key":
        assert "refused a connection with an unknown CURVE key" in out, out


def test_a_rank_with_another_secret_cannot_join():
    """Rank 1 holds a different job secret: rank 0's store refuses it, both get typed errors."""
    _, out = run_ranks(2, "failures", "secret_mix", env={**DEFAULT, "COMMRT_COMM_TIMEOUT_S": "3"},
                       timeout_s=60, expect_fail=False)
    assert "CAUGHT RendezvousError" in out and "job secret or keys" in out, out
    assert "wrong job secret" in out, out


def test_plaintext_job_cannot_join_a_curve_job():
    """Half the ranks without keys: rendezvous with rank 0's store fails, with a typed error."""
    _, out = run_ranks(2, "failures", "curve_mix", env={**CURVE, "COMMRT_COMM_TIMEOUT_S": "3"},
                       timeout_s=60, expect_fail=False)
    assert "CAUGHT RendezvousError" in out and "did not answer" in out, out
