"""Review of the observability layer (revB), on real ranks: each test failed before its fix."""
import pytest

from commrt.obs import analyze, flight
from tests.multirank.harness import run_ranks


def test_a_receive_from_any_source_is_not_numbered_as_a_collective(tmp_path):
    """``recv(t)`` without ``src`` reached the recorder with peer -1, which it took for a
    collective: the receiver's collective seq ran one ahead of the sender's from then on, and
    the analysis of two healthy ranks reported every later collective as a mismatch."""
    env = {"COMMRT_COMM_BACKEND": "zmq", "COMMRT_LOG_FLIGHT_DIR": str(tmp_path)}
    run_ranks(2, "obs_anysource", env=env, timeout_s=60)
    dumps = flight.read_dumps(str(tmp_path))
    findings, lines = analyze.analyze(dumps, 2)
    assert findings == [], "\n".join(lines)
    for d in dumps:
        (world,) = d["groups"]
        assert [(e["seq"], e["op"]) for e in world["entries"] if e["kind"] == "coll"] == \
            [(1, "all_reduce"), (2, "all_reduce"), (3, "broadcast")], d["rank"]
        assert [(e["kind"], e["op"]) for e in world["entries"] if e["op"] in ("send", "recv")] == \
            [("p2p", "recv" if d["rank"] == 0 else "send")]


@pytest.mark.parametrize("backend", ["zmq", "gloo"])
def test_a_wait_that_times_out_writes_the_flight_record_on_every_backend(backend, tmp_path):
    """README: a CommTimeout from ``Work.wait(timeout)`` writes the flight record. On gloo (and
    nccl) the timeout was raised by the torch backend's own wait, which never told the
    recorder: no record at all."""
    env = {"COMMRT_COMM_BACKEND": backend, "COMMRT_LOG_FLIGHT_DIR": str(tmp_path)}
    _, out = run_ranks(2, "obs_timeout", env=env, timeout_s=90)
    assert "[rank 0] CAUGHT CommTimeout" in out, out
    (dump,) = flight.read_dumps(str(tmp_path))
    assert dump["rank"] == 0 and dump["reason"].startswith("CommTimeout"), dump["reason"]


def test_an_async_gloo_collective_is_timed_to_its_completion_not_to_the_wait():
    """TorchWork learned that a gloo op had finished only at wait(): the comms log's time of an
    async all_reduce included the program's compute until it waited. torch's future of the work
    now stamps the end (integrations/torch_backend.TorchWork)."""
    env = {"COMMRT_COMM_BACKEND": "gloo", "COMMRT_LOG_COMMS": "1"}
    _, out = run_ranks(2, "obs_gloo_end", env=env, timeout_s=90)
    assert out.count("ENDED BEFORE WAIT") == 2, out
