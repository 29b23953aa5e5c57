"""runtime/work.Flag: Event's interface with the Event made only for a waiter that blocks; a
waiter racing the setter never misses the wake-up (issue 29: the p2p per-message path)."""
import threading
import time

from commrt.runtime.work import Flag, Work


def test_a_work_finished_before_anyone_waits_never_makes_an_event():
    w = Work("send")
    w._finish(None, None)
    assert w.wait(0) and w.is_completed() and w._done._event is None


def test_a_blocked_waiter_wakes_when_the_work_finishes():
    w = Work("recv")
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("ok", w.wait(5.0)))
    t.start()
    while w._done._event is None:  # the waiter is about to block on its Event
        time.sleep(0.001)
    start = time.monotonic()
    w._finish(3, None)
    t.join(5.0)
    assert got == {"ok": True} and w.result() == 3 and time.monotonic() - start < 1.0


def test_wait_times_out_false_and_set_then_wait_is_true():
    f = Flag()
    assert f.wait(0.01) is False and not f.is_set()
    f.set()
    assert f.is_set() and f.wait(0) is True and f.wait() is True


def test_waiters_racing_the_setter_all_wake():
    """1,000 rounds of a setter against two waiters: a lost wake-up would leave a waiter at its
    5 s timeout (False)."""
    for _ in range(1000):
        f = Flag()
        results = []
        waiters = [threading.Thread(target=lambda: results.append(f.wait(5.0))) for _ in range(2)]
        for t in waiters:
            t.start()
        f.set()
        for t in waiters:
            t.join(6.0)
        assert results == [True, True]
