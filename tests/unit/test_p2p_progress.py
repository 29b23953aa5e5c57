"""transport/progress.py without sockets: one reader of a group's inbound socket at a time, and a
caller that cannot have it is woken as soon as the reader lands its receive (or lets go), never
left waiting on a socket another thread reads for it."""
import threading
import time

from commrt.transport.progress import ENGINE, Reader


def test_a_waiter_wakes_when_the_reader_lands_its_receive_not_at_its_deadline():
    reader = Reader(lambda: None)
    assert reader.try_take("A")
    done = threading.Event()
    got = {}

    def waiter():
        start = time.monotonic()
        got["took"] = reader.take("B", done.is_set, time.monotonic() + 5.0)
        got["s"] = time.monotonic() - start

    t = threading.Thread(target=waiter)
    t.start()
    while not reader.wanted:
        time.sleep(0.001)
    done.set()  # A's read landed B's message ...
    reader.landed()  # ... and says so
    t.join(5.0)
    assert got == {"took": False, "s": got["s"]} and got["s"] < 1.0
    assert reader.holder == "A"


def test_the_engine_is_asked_to_give_the_socket_up_and_the_caller_gets_it():
    asked = []
    reader = Reader(lambda: asked.append(1))
    assert reader.try_take(ENGINE)
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("took", reader.take("C", lambda: False,
                                                                               time.monotonic() + 5.0)))
    t.start()
    deadline = time.monotonic() + 5.0
    while not asked and time.monotonic() < deadline:
        time.sleep(0.001)
    assert asked and reader.wanted == 1  # the engine's loop sees this and releases
    reader.release()
    t.join(5.0)
    assert result == {"took": True} and reader.holder == "C" and reader.wanted == 0
    assert not reader.try_take(ENGINE)


def test_a_waiter_gives_up_at_its_deadline():
    reader = Reader(lambda: None)
    assert reader.try_take("A")
    start = time.monotonic()
    assert not reader.take("B", lambda: False, time.monotonic() + 0.05)
    assert 0.04 < time.monotonic() - start < 2.0 and reader.wanted == 0
