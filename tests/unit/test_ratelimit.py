"""Rate-limited warnings (issue 30 item 14): a flood becomes a few lines and a count."""
import logging

from commrt.obs.ratelimit import RateLimited


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_a_flood_logs_the_first_lines_then_one_summary_per_interval(caplog):
    clock = _Clock()
    limited = RateLimited(logging.getLogger("test.ratelimit"), burst=3, interval_s=10, clock=clock)
    with caplog.at_level(logging.WARNING, logger="test.ratelimit"):
        for i in range(1000):
            limited.warning("wrong secret", "refused connection %d", i)
        assert len(caplog.records) == 3
        assert "further wrong secret warnings held back for 10s" in caplog.records[-1].getMessage()
        clock.t = 11
        limited.warning("wrong secret", "refused connection %d", 1000)
        assert "997 more wrong secret warnings in the last 11s" in caplog.records[3].getMessage()
        assert caplog.records[4].getMessage() == "refused connection 1000"
        limited.warning("other kind", "unrelated")  # kinds are limited apart
        assert caplog.records[-1].getMessage() == "unrelated"
        for _ in range(5):
            limited.warning("wrong secret", "again")
        limited.flush()
        assert "3 more wrong secret warnings" in caplog.records[-1].getMessage()
    assert len(caplog.records) == 3 + 2 + 1 + 2 + 1


def test_wrong_secret_connections_log_a_few_lines_not_one_each(caplog):
    """The probe's 1,241 lines in 17 s: a client retrying with a wrong secret."""
    from commrt.obs import ratelimit
    from commrt.transport import security
    from types import SimpleNamespace
    auth = SimpleNamespace(_secret=b"the job secret")  # the ZAP thread's state is not needed
    check = security._SecretAuthenticator._authenticate_plain
    with caplog.at_level(logging.WARNING, logger=security.log.name):
        for i in range(500):
            assert check(auth, security.DOMAIN, f"intruder{i}", "guess") == (False, b"wrong job secret")
    assert len(caplog.records) <= ratelimit.BURST


def test_rejected_ps_requests_log_a_few_lines_not_one_each(caplog):
    """The probe's 21,000 lines of refused pulls."""
    from types import SimpleNamespace

    from commrt.obs import ratelimit
    from commrt.ps import core, protocol
    server = core.ServerCore.__new__(core.ServerCore)
    server.index, server.counters = 0, {"rejected": 0}
    pull = next(op for op, name in protocol.OP_NAMES.items() if name == "pull")
    with caplog.at_level(logging.WARNING, logger=core.log.name):
        for i in range(500):
            server._rejected(b"id", SimpleNamespace(op=pull, worker=0, req_id=i), "worker 0 has no accepted init")
    assert server.counters["rejected"] == 500 and len(caplog.records) <= ratelimit.BURST


_FLOOD_THEN_EXIT = """
import logging, sys
from commrt.obs.ratelimit import RateLimited
logging.basicConfig(stream=sys.stdout, format="%(message)s")
limited = RateLimited(logging.getLogger("test.flood"), burst=3, interval_s=60)
for i in range(100):
    limited.warning("wrong secret", "refused connection %d", i)
"""


def test_a_flood_that_stopped_is_counted_when_the_process_ends():
    """Found in review (revB): the count of a flood that stopped was only logged by flush() or
    by the kind's next occurrence after the interval, and nothing called flush(): 97 refused
    connections beyond the first 3 were never reported. Now each limiter flushes at exit."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", _FLOOD_THEN_EXIT], timeout=60, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": root})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("refused connection") == 3
    assert "97 more wrong secret warnings" in proc.stdout, proc.stdout
