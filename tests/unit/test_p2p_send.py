"""transport/p2p_send.py without processes: per-destination send queues over a socket that
takes nothing until told (a full pipe), against the deadline each send is given."""
import zmq

from commrt.runtime.errors import PeerLost
from commrt.transport.liveness import Liveness
from commrt.transport.p2p_send import Send, Sender
from commrt.transport.wire import P2P, Header


class Pipe:
    """A PUSH socket whose pipe takes ``room`` more frames (a message's first frame is refused
    when full; zmq takes the rest of a message whose first it took)."""

    def __init__(self):
        self.room, self.sent = 0, []

    def send(self, data, flags=0, copy=True, track=False):
        if self.room <= 0 and flags & zmq.NOBLOCK:
            raise zmq.Again()
        self.room -= 1
        self.sent.append(bytes(data))


class Ep:
    rank, group = 0, 0

    def __init__(self):
        self.pipe = Pipe()
        self.live = Liveness(slice_s=0.1, grace_s=1.0, timeout_s=30.0)

    def socket_to(self, dst):
        return self.pipe

    def count_sent(self, dst, kind, op, nbytes):
        pass


class Done:
    def __init__(self):
        self.error = None
        self._done = self

    def is_set(self):
        return self.error is not None

    def _finish(self, result, error):
        self.error = error


def failures(out):
    """(seq, error) of the sends ``out`` decided failed since the last look (the engine
    finishes them, outside its lock)."""
    return [(op.seq, error) for op, error in out.settled() if error is not None]


def send(seq, since):
    payload = bytes([seq]) * 8
    op = Send(1, 0, seq, [(Header(P2P, 0, seq, 0, 0, 1, 8, 0, 8), payload)], Done())
    op.since = since
    return op


def test_a_send_queued_behind_another_waits_from_when_the_one_before_it_went():
    """Sends queued to one peer: the pipe taking the first is progress, so the second's
    deadline counts from then (a pipeline's sends behind a slow receiver), not from its posting."""
    ep = Ep()
    out = Sender(ep, 5.0)
    first, second = send(1, 0.0), send(2, 0.0)
    assert out.post(first) and out.post(second)  # the pipe is full: the engine has them
    ep.pipe.room = 2  # header and payload of the first
    out.progress(4.0)
    assert len(ep.pipe.sent) == 2 and not failures(out)
    out.progress(6.0)  # 2 s after the first went: not overdue
    assert not failures(out)
    out.progress(9.5)
    failed = failures(out)
    assert [seq for seq, _ in failed] == [2] and isinstance(failed[0][1], PeerLost)


def test_sends_to_a_peer_whose_connection_is_lost_fail_naming_it():
    """Queued sends and new ones to a peer lost by liveness fail at once (ZeroMQ would hold or
    drop them until the deadline); a peer down for less than the grace is still waited for."""
    ep = Ep()
    out = Sender(ep, 30.0)
    queued = send(1, 0.0)
    out.post(queued)
    ep.live.down[1] = 1.0  # its connection dropped at 1.0; the grace is 1 s
    out.progress(1.5)
    assert not failures(out)
    out.progress(2.5)
    failed = failures(out)
    assert [seq for seq, _ in failed] == [1] and failed[0][1].rank == 1 and failed[0][1].op == "send"
    assert not out.post(send(2, 3.0)) and [seq for seq, _ in failures(out)] == [2]
    assert not ep.pipe.sent and not out.busy()
