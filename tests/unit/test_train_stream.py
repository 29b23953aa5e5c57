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


def test_hybrid_replica_all_reduce_keeps_the_hooks_order_on_the_stream():
    """Issue 30.22: ZeRO++ with HYBRID_SHARD. Unit A's reduce-scatter finishes only after unit
    B's hook ran; the replica all-reduce of A must still enter the stream right after A's
    reduce-scatter (as it does when A finishes early), not wherever progress() first saw A done."""
    import torch
    from torch import nn

    from commrt.train.breakdown import StepClock
    from commrt.train.layout import make_unit
    from commrt.train.units import UnitState
    from commrt.train.zero import Zero

    z = Zero.__new__(Zero)  # the queue and stream logic alone: no process group
    z.world, z.stage, z.qgz, z.dtype, z.overlap, z.rgroup = 2, 2, False, torch.float32, True, "replicas"
    z.stream, z.works, z.clock, z.nonfinite, z.started_early = CommStream("test-stream"), [], StepClock(), False, 0
    z.defer = False
    issued, rs = [], {"A": Work("rs A"), "B": Work("rs B")}
    units = {}
    for name in "AB":
        p = nn.Parameter(torch.ones(4))
        p.grad = torch.ones(4)
        u = UnitState(make_unit([0], [4], 2), [p], (0, 2))
        u.grad, u.name = torch.zeros(2), name
        units[name] = u

    outs = {}  # the reduce-scatter's output -> its unit: the replica all-reduce reduces it

    def start_rs(out, flat, u):
        issued.append(f"reduce_scatter {u.name}")
        outs[id(out)] = u.name
        out.copy_(flat[:2])
        return rs[u.name]

    z._start_reduce_scatter = start_rs
    z._start_replica_all_reduce = lambda out: issued.append(f"replica all_reduce {outs[id(out)]}")
    z.reduce(units["A"])
    rs["A"]._finish(None, None)  # A's data arrives after its hook ...
    z.fence()
    z.reduce(units["B"])  # ... and B's hook is the first progress() to see it
    rs["B"]._finish(None, None)
    z.wait()
    assert issued == ["reduce_scatter A", "replica all_reduce A", "reduce_scatter B", "replica all_reduce B"]
    assert all(torch.equal(u.grad, torch.ones(2)) for u in units.values())
    z.stream.close()


def test_chained_starts_the_second_when_the_first_ends_and_hands_on_errors():
    """HYBRID_SHARD without the stream (stream.Chained): the replica all-reduce starts in the
    thread that finished the reduce-scatter, in the reduce-scatters' order; done only when it
    is; either one's error reaches the waiter, and a failed first starts nothing."""
    from commrt.train.stream import Chained

    started, firsts, seconds = [], [Work(f"rs{i}") for i in range(3)], [Work(f"ar{i}") for i in range(3)]
    chains = [Chained(f"c{i}", f, lambda i=i: (started.append(i), seconds[i])[-1]) for i, f in enumerate(firsts)]
    assert started == [] and not any(c.is_completed() for c in chains)
    for f in firsts[:2]:
        f._finish(None, None)
    assert started == [0, 1] and not chains[0].is_completed()  # started, not yet done
    threading.Timer(0.05, lambda: seconds[0]._finish(None, None)).start()
    assert chains[0].wait(5) and chains[0].is_completed()
    seconds[1]._finish(None, RuntimeError("replica peer lost"))
    with pytest.raises(RuntimeError, match="replica peer lost"):
        chains[1].wait(5)
    firsts[2]._finish(None, RuntimeError("shard peer lost"))
    with pytest.raises(RuntimeError, match="shard peer lost"):
        chains[2].wait(5)
    assert started == [0, 1]  # the failed reduce-scatter started no all-reduce
    done = Work("done")
    done._finish(None, None)
    assert Chained("late", done, lambda: None).wait(5)  # a first already finished starts at once
