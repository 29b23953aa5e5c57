"""A mismatch report passed on to every peer (contract.restate_report) names the right ranks:
the rank whose message was refused is told the reporter's side, never that its own header is
"corrupt", and a stray from an earlier op is reported as that op (context.OpContext.refused)."""
import types

import numpy as np

from commrt.collectives.context import Coll, Journal, OpContext
from commrt.collectives.contract import restate_report
from commrt.transport.messages import MismatchReport
from commrt.transport.wire import COLL

F32 = np.dtype(np.float32)


def ctx(rank, seq, coll=Coll.ALL_TO_ALL, count=0, link=None, journal=None, root=0):
    return OpContext(link, 0, rank, 3, seq, coll, F32, count, 1 << 20, 1 << 16, root=root, journal=journal)


def test_the_rank_whose_piece_was_refused_is_told_the_reporters_side():
    """Rank 2 expected 4 bytes from rank 1 in an all_to_all and got none: rank 1 (same op, other
    piece sizes) used to read "a header attributed to rank 1 ... corrupt"."""
    want, got = ctx(2, 2).header(4, 0), ctx(1, 2).header(0, 0)
    e = restate_report(MismatchReport(2, want, got), ctx(1, 2))
    assert "corrupt" not in str(e) and (e.rank, e.peer, e.reported_by) == (1, 2, 2), e
    assert "rank 1 runs {seq=2, op=all_to_all, dtype=float32, count=0, step=0, bytes=0}" in str(e), e
    assert "rank 2 runs {seq=2, op=all_to_all, dtype=float32, count=0, step=0, bytes=4}" in str(e), e
    bystander = restate_report(MismatchReport(2, want, got), ctx(0, 2))  # both sides look like its own op
    assert (bystander.rank, bystander.peer) == (2, 1) and "corrupt" not in str(bystander), bystander


def test_a_stray_from_an_earlier_op_is_reported_as_that_op():
    """Rank 1 ran seq 2's broadcast with no elements and went on to a barrier; rank 0's pieces
    of seq 2 reached it there. The report carries rank 1's seq-2 broadcast, so rank 0 (at its
    own barrier) is told what rank 1 ran, not that its own broadcast header is corrupt."""
    journal = Journal()
    ctx(1, 2, Coll.BROADCAST, count=0, journal=journal)
    stray = ctx(0, 2, Coll.BROADCAST, count=8).header(32, 0)
    link = types.SimpleNamespace(recv=lambda *a, **k: types.SimpleNamespace(header=stray, payload=None))
    barrier = OpContext(link, 0, 1, 3, 3, Coll.BARRIER, np.dtype(np.uint8), 0, 1 << 20, 1 << 16, journal=journal)
    try:
        barrier.recv_buffer(0, 0)
        raise AssertionError("no mismatch")
    except Exception as exc:  # noqa: BLE001 (checked below)
        assert type(exc).__name__ == "CollectiveMismatch", exc
    mine, theirs = barrier.refused
    assert (mine.seq, mine.src, mine.count, Coll(mine.op & 0xFF), theirs) == (2, 1, 0, Coll.BROADCAST, stray)
    e = restate_report(MismatchReport(1, mine, theirs), ctx(0, 3, Coll.BARRIER))
    assert "corrupt" not in str(e) and (e.rank, e.peer) == (0, 1), e
    assert "rank 1 runs {seq=2, op=broadcast, dtype=float32, count=0, root=0}" in str(e), e
    assert mine.kind == COLL
