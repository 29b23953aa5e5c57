"""REFUSE notices between two real endpoints (two Transports, as two processes would have): what
a receiver keeps of them is bounded, and one for the op it runs ends it naming the refusing rank."""
from __future__ import annotations

import pytest

from commrt.runtime.config import load_config
from commrt.runtime.errors import OpRefused
from commrt.transport import Endpoint, Transport, notices
from commrt.transport.endpoint import KEPT_REFUSALS
from commrt.transport.wire import Coll


@pytest.fixture()
def pair():
    cfg = load_config(None, {"comm": {"backend": "zmq"}, "security": {"mode": "none"}})
    names = ["rank0", "rank1"]
    sides = [Transport(cfg, "rank0"), Transport(cfg, "rank1")]
    eps = [Endpoint(sides[r], 0, r, names, "127.0.0.1", "", 1 << 20, 3.0, 10.0) for r in (0, 1)]
    for ep in eps:
        ep.connect({0: eps[0].address, 1: eps[1].address})
    yield eps
    for ep in eps:
        ep.close()
    for t in sides:
        t.close()


def test_refusals_of_later_ops_are_kept_within_a_bound_and_this_ops_fails(pair):
    refuser, peer = pair
    for seq in range(2, 2 + 3 * KEPT_REFUSALS):  # ops the peer has not reached: kept for then
        refuser.refuse(seq, int(Coll.ALL_REDUCE), "ValueError: read-only")
    refuser.refuse(1, int(Coll.BARRIER), "TypeError: dtypes differ")
    with pytest.raises(OpRefused) as err:  # the peer runs op 1 and waits on the refusing rank
        peer.recv(0, op="barrier", seq=1, timeout_s=10.0)
    assert err.value.rank == 0 and err.value.op == "barrier" and "dtypes differ" in str(err.value)
    assert len(peer.refusals) <= KEPT_REFUSALS
    last = 1 + 3 * KEPT_REFUSALS
    assert isinstance(peer.refusal_at(last), OpRefused)


def test_a_refusal_naming_a_rank_outside_the_group_is_dropped(pair):
    refuser, peer = pair
    refuser.socket_to(1)  # passed-on refusals go to the peers already connected
    notices.tell_refused(refuser, 1, int(Coll.ALL_REDUCE), 5, "no such rank")
    refuser.refuse(1, int(Coll.ALL_REDUCE), "ValueError: read-only")
    with pytest.raises(OpRefused) as err:
        peer.recv(0, op="all_reduce", seq=1, timeout_s=10.0)
    assert err.value.rank == 0 and peer.dropped == 1
