"""ZeRO++'s comm stream (commrt/train/stream.py), without processes: submission order, a
submitted collective done only when what it started is done, errors handed to the waiter."""
import threading

import pytest

from commrt.train.stream import CommStream
from commrt.runtime.work import Work


def test_runs_in_submission_order_and_fence_waits_for_all():
    stream, seen, gate = CommStream("test-stream"), [], threading.Event()
    first = stream.submit("a", lambda: (gate.wait(5), seen.append("a"))[-1])
    rest = [stream.submit(n, lambda n=n: seen.append(n)) for n in "bcd"]
    assert not first.is_completed() and seen == []  # the stream is held by "a"
    gate.set()
    stream.fence()
    assert seen == list("abcd") and first.is_completed() and all(w.is_completed() for w in rest)
    stream.close()


def test_done_only_when_the_started_collective_is_done():
    stream, inner = CommStream("test-stream"), Work("collective")
    streamed = stream.submit("start", lambda: inner)
    stream.fence()  # issued ...
    assert not streamed.is_completed()  # ... but its data is not there yet
    threading.Timer(0.05, lambda: inner._finish(None, None)).start()
    streamed.wait()
    assert streamed.is_completed()
    stream.close()


def test_errors_reach_the_waiter_and_the_stream_goes_on():
    stream, inner = CommStream("test-stream"), Work("collective")
    failed = stream.submit("raises", lambda: 1 / 0)
    inner._finish(None, RuntimeError("peer lost"))
    later = stream.submit("fails later", lambda: inner)
    with pytest.raises(ZeroDivisionError):
        failed.wait()
    with pytest.raises(RuntimeError, match="peer lost"):
        later.wait()
    assert stream.submit("after", lambda: None).wait() is None
    stream.close()
