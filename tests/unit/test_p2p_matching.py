"""transport/matching.py without processes: which posted receive each arriving message lands in
(posting order between receives from one peer and from any, the earliest kept message first,
multi-piece messages, sequence numbers) against what MPI's matching rules say."""
import numpy as np

from commrt.runtime.errors import CollectiveMismatch
from commrt.transport.endpoint import Message
from commrt.transport.matching import ANY_SOURCE, Matching
from commrt.transport.p2p import Recv
from commrt.transport.wire import P2P, Header


class Done:
    def __init__(self):
        self.result, self.error, self.finished = None, None, False

    def _finish(self, result, error):
        self.result, self.error, self.finished = result, error, True


def recv(src, tag=0, pieces=1, count=2):
    bufs = [np.zeros(count, dtype=np.float32) for _ in range(pieces)]
    return Recv(src, tag, 0, 1, count * pieces, bufs, lambda dst, b: dst.__setitem__(slice(None), b), None, Done())


def msg(src, seq, value, tag=0, step=0, pieces=1, count=2):
    payload = np.full(count, value, dtype=np.float32)
    return Message(Header(P2P, 0, seq, src, tag, 1, count * pieces, step, payload.nbytes), payload)


def matching():
    bound = []
    return Matching(0, bound.append, lambda m: None, lambda: 0.0), bound


def test_a_receive_from_one_peer_posted_first_takes_its_first_message():
    m, bound = matching()
    one, anyone = recv(1), recv(ANY_SOURCE)
    m.post(one)
    m.post(anyone)
    assert m.arrive(msg(1, 1, 10.0)) and m.arrive(msg(1, 2, 20.0))
    assert one.pieces[0][0] == 10 and anyone.pieces[0][0] == 20
    assert anyone.work.result == 1 and one.work.result == 1 and not one.work.error and not anyone.work.error


def test_a_receive_from_any_posted_first_takes_it_and_the_rest_keep_their_numbers():
    m, _ = matching()
    anyone, one = recv(ANY_SOURCE), recv(1)
    m.post(anyone)
    m.post(one)
    assert m.arrive(msg(1, 1, 10.0)) and m.arrive(msg(1, 2, 20.0))
    assert anyone.pieces[0][0] == 10 and one.pieces[0][0] == 20
    assert not one.work.error  # the receive from 1 expects the sender's second message (seq 2)


def test_kept_messages_go_to_receives_from_any_earliest_arrival_first():
    m, bound = matching()
    for src, seq, value in ((2, 1, 20.0), (1, 1, 10.0), (2, 2, 21.0)):
        assert not m.arrive(msg(src, seq, value))  # nothing posted: the engine keeps it
        m.keep(msg(src, seq, value))
    got = [recv(ANY_SOURCE) for _ in range(3)]
    for r in got:
        m.post(r)
    assert [(r.work.result, r.pieces[0][0]) for r in got] == [(2, 20.0), (1, 10.0), (2, 21.0)]
    assert not any(r.work.error for r in got) and not m.early_bytes[1] and not m.early_bytes[2]
    assert bound == [2, 1, 2]  # the engine watches each sender a receive waits on


def test_a_message_in_pieces_stays_with_the_receive_that_took_its_first_piece():
    m, _ = matching()
    first, second = recv(ANY_SOURCE, pieces=2), recv(ANY_SOURCE, pieces=2)
    m.post(first)
    m.post(second)
    m.arrive(msg(1, 1, 1.0, step=0, pieces=2))
    m.arrive(msg(2, 1, 2.0, step=0, pieces=2))  # rank 2's message goes to the second receive
    m.arrive(msg(1, 1, 1.5, step=1, pieces=2))
    m.arrive(msg(2, 1, 2.5, step=1, pieces=2))
    assert (first.work.result, second.work.result) == (1, 2)
    assert [p[0] for p in first.pieces] == [1.0, 1.5] and [p[0] for p in second.pieces] == [2.0, 2.5]


def test_a_receive_from_one_peer_in_the_middle_of_a_message_keeps_it_from_a_later_any():
    m, _ = matching()
    one = recv(1, pieces=2)
    m.post(one)
    m.arrive(msg(1, 1, 1.0, step=0, pieces=2))
    anyone = recv(ANY_SOURCE, pieces=2)
    m.post(anyone)
    m.arrive(msg(1, 1, 1.5, step=1, pieces=2))
    assert one.work.result == 1 and not one.work.error and not anyone.work.finished


def test_a_wrong_count_or_number_fails_that_receive_only():
    m, _ = matching()
    a, b = recv(ANY_SOURCE), recv(ANY_SOURCE)
    m.post(a)
    m.post(b)
    m.arrive(msg(1, 1, 1.0, count=3))
    assert isinstance(a.work.error, CollectiveMismatch) and "count=3" in str(a.work.error)
    m.arrive(msg(1, 3, 1.0))  # the sender's third message where its second is due
    assert isinstance(b.work.error, CollectiveMismatch) and "seq=3" in str(b.work.error)


def test_an_expired_receive_uses_its_number():
    m, _ = matching()
    m.post(recv(1))
    m.pop(m.recvs[(1, 0)])  # the engine's deadline removed it: the sender's first message is its
    nxt = recv(1)
    m.post(nxt)
    m.arrive(msg(1, 2, 5.0))
    assert nxt.pieces[0][0] == 5.0 and nxt.work.result == 1 and not nxt.work.error


def test_overdue_receives_name_the_lost_sender_or_time_out_and_leave_the_rest():
    from commrt.runtime.errors import PeerLost
    from commrt.transport.liveness import Liveness
    m, _ = matching()
    live = Liveness(slice_s=0.1, grace_s=1.0, timeout_s=30.0)
    from_1, from_2, anyone, fresh = recv(1), recv(2), recv(ANY_SOURCE, tag=5), recv(3)
    for op in (from_1, from_2, anyone, fresh):
        m.post(op)
        op.since = 100.0
    fresh.since = 109.0
    live.down[2] = 95.0  # rank 2 dropped 10 s ago: past the grace
    out = dict((id(op), e) for op, e in m.overdue(105.0 + 0.5, timeout_s=5.0, live=live))
    assert set(out) == {id(from_1), id(from_2), id(anyone)}  # fresh saw progress 3.5 s ago
    assert all(isinstance(e, PeerLost) for e in out.values())
    assert out[id(from_1)].rank == 1 and "timeout after 5s" in str(out[id(from_1)])
    assert out[id(from_2)].rank == 2 and "connection lost" in str(out[id(from_2)])
    assert out[id(anyone)].rank == 2 and "from any source (tag 5)" in str(out[id(anyone)])
    assert list(m.recvs[(3, 0)]) == [fresh] and not m.recvs[(1, 0)] and not m.any[5]
    assert m.overdue(105.5, timeout_s=5.0, live=live) == []  # each reported once


def test_the_rest_of_a_mismatched_message_in_pieces_goes_to_no_later_receive():
    """A receive too small for the sender's message fails on its first piece; the pieces still
    coming belong to that failed receive, not to the next ones, which take the sender's next
    messages (posted before the rest arrives, after it, and from any source)."""
    for when in ("before", "after", "any"):
        m, _ = matching()
        small = recv(1)
        m.post(small)
        m.arrive(msg(1, 1, 1.0, step=0, pieces=2))  # two pieces of 2 where the receive holds 2
        assert isinstance(small.work.error, CollectiveMismatch), when
        nxt = recv(ANY_SOURCE) if when == "any" else recv(1)
        if when == "before":
            m.post(nxt)
        if not m.arrive(msg(1, 1, 1.5, step=1, pieces=2)):
            m.keep(msg(1, 1, 1.5, step=1, pieces=2))
        if when != "before":
            m.post(nxt)
        assert not nxt.work.finished, (when, nxt.work.error)
        assert m.arrive(msg(1, 2, 7.0))
        assert nxt.work.finished and nxt.work.error is None and nxt.pieces[0][0] == 7.0, (when, nxt.work.error)
        assert not m.early_bytes[1], when  # nothing of the failed message is kept


def test_a_message_that_comes_after_its_receive_expired_goes_to_no_later_receive():
    m, _ = matching()
    m.post(recv(1))
    m.pop(m.recvs[(1, 0)])  # expired: the sender's first message was its
    nxt = recv(1)
    m.post(nxt)
    assert m.arrive(msg(1, 1, 5.0))  # late: dropped, not landed in the next receive
    assert not nxt.work.finished, nxt.work.error
    m.arrive(msg(1, 2, 6.0))
    assert nxt.pieces[0][0] == 6.0 and nxt.work.error is None


def test_a_receive_queued_behind_another_waits_from_when_it_became_first():
    """Receives posted ahead (a pipeline's irecvs) wait for their turn: the deadline of each
    counts from the message of the one before it, not from its own posting."""
    from commrt.transport.liveness import Liveness
    now = [0.0]
    m = Matching(0, lambda src: None, lambda msg: None, lambda: now[0])
    live = Liveness(slice_s=0.1, grace_s=1.0, timeout_s=30.0)
    first, second = recv(1), recv(1)
    any_first, any_second = recv(ANY_SOURCE, tag=5), recv(ANY_SOURCE, tag=5)
    for op in (first, second, any_first, any_second):
        m.post(op)
        op.since = 0.0
    now[0] = 4.0
    m.arrive(msg(1, 1, 1.0))
    m.arrive(msg(2, 1, 2.0, tag=5))
    assert first.work.result == 1 and any_first.work.result == 2
    assert m.overdue(6.0, timeout_s=5.0, live=live) == []  # 2 s since each became first
    late = dict((id(op), e) for op, e in m.overdue(9.5, timeout_s=5.0, live=live))
    assert set(late) == {id(second), id(any_second)}


def test_a_failing_done_callback_takes_no_other_receive_with_it():
    """A receive's Work calls its done-callbacks as it finishes; one that raises must not make
    the matching remove the next receive too (which then would never finish: a hang)."""
    class Raises(Done):
        def _finish(self, result, error):
            first = not self.finished
            super()._finish(result, error)
            if first:
                raise RuntimeError("callback failed")
    m, _ = matching()
    first, second = recv(1), recv(1)
    first.work = Raises()
    m.post(first)
    m.post(second)
    m.arrive(msg(1, 1, 1.0))
    assert first.work.result == 1 and first.work.error is None
    assert list(m.recvs[(1, 0)]) == [second]
    m.arrive(msg(1, 2, 2.0))
    assert second.work.result == 1 and second.work.error is None and second.pieces[0][0] == 2.0
