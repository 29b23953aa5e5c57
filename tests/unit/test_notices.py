"""The ABORT notices a rank reads beside the data (transport/notices.py): a peer's mismatch
report about a later op than the one this rank is in is kept for that op, not raised in this one."""
from __future__ import annotations

import pytest
import zmq

from commrt.transport import notices
from commrt.transport.endpoint import Endpoint
from commrt.transport.messages import Message, MismatchReport, encode_report
from commrt.transport.wire import ABORT, COLL, Coll, Header


class _Ep:
    """What notices.aborted touches of an Endpoint: its deferred refusals and their bound."""
    rank, dropped = 0, 0

    def __init__(self):
        self.refusals = {}
        self.refused_here = {}

    keep_refusals_bounded = Endpoint.keep_refusals_bounded
    refusal_at = Endpoint.refusal_at


def _report(seq: int) -> Message:
    """Rank 1's report: at ``seq`` it ran a reduce of 8 elements, rank 2 one of 0."""
    mine = Header(COLL, 0, seq, 1, int(Coll.REDUCE), 1, 8, 0, 32)
    theirs = mine._replace(src=2, count=0, nbytes=0)
    payload = encode_report(mine, theirs)
    return Message(Header(ABORT, 0, seq, 1, 0, 0, 0, 0, len(payload)), zmq.Frame(payload))


def test_a_report_of_this_op_fails_it():
    with pytest.raises(MismatchReport):
        notices.aborted(_Ep(), _report(2), "reduce", 2)


def test_a_report_of_a_later_op_waits_for_that_op():
    """Seen under a busy loop: rank 0, still in the init barrier its peers had left, read their
    report of the next op (a reduce whose counts differ) and failed the barrier with it."""
    ep = _Ep()
    notices.aborted(ep, _report(2), "barrier", 1)  # raised here before
    assert ep.refusal_at(1) is None
    got = ep.refusal_at(2)
    assert isinstance(got, MismatchReport) and got.reporter == 1 and got.theirs.count == 0
