"""The small-op fast path of the shared-memory transport (issue 17), without processes: the
cached numpy views alias the segment's bytes, a header goes out word for word, a reused op
context is the context a fresh build gives, the numpy reduction keeps the rank order, and a
wait yields the core instead of sleeping for the timer slack, then sleeps once it has waited
longer than a short spin."""
import collections
import time
import types

import numpy as np
import pytest
import torch

from commrt.collectives import shm_ops
from commrt.collectives.context import Coll
from commrt.collectives.reduce_ops import ReduceOp, numpy_dtype, reduce_arrays_
from commrt.runtime.errors import PeerLost
from commrt.transport import shm
from commrt.transport.endpoint import Endpoint
from commrt.transport.liveness import Liveness
from commrt.transport.transport import Counters

SLOT = 4096
_TORCH = {ReduceOp.SUM: torch.add, ReduceOp.AVG: torch.add, ReduceOp.PRODUCT: torch.mul,
          ReduceOp.MIN: torch.minimum, ReduceOp.MAX: torch.maximum}


class _Ep:
    """What a Channel reads of its Endpoint: rank, names, counters, and the waiting rules."""

    def __init__(self, rank: int, size: int):
        self.rank, self.group, self.names = rank, 0, [f"rank{r}" for r in range(size)]
        self.counters = Counters()  # the transport's, as the real Endpoint registers its tables
        self._counters = [self.counters.peer(n) for n in self.names]
        self._op_sent = self.counters.op_table()
        self._op_msgs = self.counters.op_table(messages=True)
        self._fanout = self.counters.fanout_table([n for p, n in enumerate(self.names) if p != rank])
        self.timeout_s, self.cancelled = 5.0, False
        self.live = Liveness(10.0, 1.0, self.timeout_s)
        self.down = self.live.down

    count_sent = Endpoint.count_sent  # the real accounting, over this fake's counters
    count_sent_to_all = Endpoint.count_sent_to_all

    def watch_peers(self) -> None:
        pass

    def read(self, flags):
        return None


@pytest.fixture
def pair():
    """Rank 0's Channel over two segments made here (rank 1's is written by the test)."""
    made = [shm.create(SLOT) for _ in range(2)]
    chan = shm.Channel(_Ep(0, 2), [mm for _, mm in made], ["a", "b"], SLOT, 1.0)
    yield chan
    chan.close()
    for fd, _ in made:
        shm.close_fd(fd)


def test_cached_views_alias_the_segments_bytes(pair):
    f32 = np.dtype(np.float32)
    for slot in (0, 1):
        every, views = pair.rows(f32, 10, slot)
        assert pair.rows(f32, 10, slot)[0] is every  # made once
        assert every.shape == (2, 10) and every.dtype == f32 and len(views) == 2
        for p in range(2):
            every[p] = np.arange(10, dtype=np.float32) + 100 * p + 1000 * slot
            at = slot * SLOT + 64 * p  # rows 64-byte aligned, in rank 0's slot
            torch_view = pair.data[0][at:at + 40].view(torch.float32)
            assert torch.equal(torch_view, torch.from_numpy(every[p].copy()))
        assert all(np.array_equal(v, every[p]) for p, v in enumerate(views))
        views[1][0] = -1
        assert every[1, 0] == -1  # views of the same memory
    for k in range(shm.MAX_CACHED_VIEWS + 5):  # bounded: a program with many sizes
        pair.rows(f32, k + 1, 0)
    assert len(pair._rows) <= shm.MAX_CACHED_VIEWS
    assert pair.rows(f32, SLOT // 4, 0) is None  # two rows of a whole slot do not fit in one


def test_a_header_is_published_word_for_word(pair):
    ctx = shm_ops.ShmContext(pair, 3, 0, 2, 41, Coll.REDUCE, torch.int64, 77, 5, ReduceOp.MAX, 1, 1 << 16)
    for aux in (0, 9):
        slot = ctx.begin(aux)
        assert pair.header(0, slot) == [pair.t + 1, 41, int(Coll.REDUCE) | 5 << 8, ctx._words[2], 77,
                                        int(ReduceOp.MAX), 1, aux]
        pair.t += 1  # as publish_and_wait would


def test_a_renewed_context_equals_a_fresh_one(pair):
    args = (pair, 0, 0, 2)
    shape = (Coll.ALL_REDUCE, torch.float32, 1024, 0, ReduceOp.AVG, 0, 1 << 16)
    reused = shm_ops.ShmContext(*args, 5, *shape)
    reused.renew(6)
    fresh = shm_ops.ShmContext(*args, 6, *shape)
    assert (reused.seq, reused._words, reused._header.tolist()) == (fresh.seq, fresh._words, fresh._header.tolist())
    assert reused.header(0, 0) == fresh.header(0, 0)  # what a mismatch error shows


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.float16])
@pytest.mark.parametrize("op", list(ReduceOp))
@pytest.mark.parametrize("n", [2, 3, 4])
def test_the_numpy_reduction_is_the_reference_order(dtype, op, n):
    gen = torch.Generator().manual_seed(n)
    parts = [(torch.randn(257, generator=gen) * 4).to(dtype) for _ in range(n)]
    fn = _TORCH[op]
    want = fn(parts[0], parts[1])  # left to right, in rank order: what every rank computes
    for p in parts[2:]:
        want = fn(want, p)
    got = np.empty(257, dtype=numpy_dtype(dtype))
    reduce_arrays_(got, [p.numpy() for p in parts], op)
    assert torch.equal(torch.from_numpy(got).view(torch.uint8), want.view(torch.uint8))


def test_numpy_dtype():
    assert numpy_dtype(torch.float32) == np.float32 and numpy_dtype(torch.int8) == np.int8
    assert numpy_dtype(torch.bfloat16) is None


def test_a_wait_yields_then_sleeps_never_for_zero(pair, monkeypatch):
    """time.sleep(0) sleeps for the timer slack (~55 us here): waits that missed the spin
    cost that much each. Yield the core while the wait is short; past YIELD_S, sleep (a
    longer wait must not keep a core busy)."""
    clock = types.SimpleNamespace(now=0.0)
    calls = collections.Counter()
    peer = pair.ctl[1]

    def advance(dt, what):
        calls[what] += 1
        clock.now += dt
        if clock.now >= 2 * shm.SHORT_NAPS_S:
            peer[shm.W_COUNTER] = pair.t  # the peer arrives

    def sleep(s):
        assert s > 0, "slept for 0: the timer slack, not a yield"
        advance(s, "sleep")
    monkeypatch.setattr(shm.time, "monotonic", lambda: clock.now)
    monkeypatch.setattr(shm.time, "sleep", sleep)
    monkeypatch.setattr(shm.os, "sched_yield", lambda: advance(pair._yield_s / 50, "yield"))
    pair.publish_and_wait("all_reduce", 1)
    assert calls["yield"] >= 40 and calls["sleep"] >= 10


def test_sent_bytes_are_counted_per_peer(pair):
    ctx = shm_ops.ShmContext(pair, 0, 0, 2, 1, Coll.ALL_GATHER, torch.float32, 8, 0, 0, 0, 1 << 16)
    ctx.sent_to_all(3)
    ctx.sent_to_all(5)
    ctx.sent(1, 2)  # counted per peer, beside the fan-out of every peer
    counters = pair.ep.counters
    got = counters.snapshot()
    assert (got["rank1"]["sent_bytes"], got["rank1"]["sent_msgs"], got["rank0"]["sent_msgs"]) == (40, 3, 0)
    assert counters.sent_by_op() == {(shm.COLL, int(Coll.ALL_GATHER), "rank1"): 40}
    assert counters.sent_by_op(messages=True) == {(shm.COLL, int(Coll.ALL_GATHER), "rank1"): 3}


def test_a_fanout_counts_every_peer_once_per_op():
    counters = Counters()
    sent = counters.fanout_table(["rank0", "rank2", "rank3"])
    sent[(shm.COLL, 4)] = [4096, 1]
    sent[(shm.COLL, 2)] = [64, 2]
    assert counters.sent_by_op() == {(shm.COLL, op, f"rank{r}"): b for r in (0, 2, 3) for op, b in ((4, 4096), (2, 64))}
    assert counters.snapshot()["rank2"] == {"sent_bytes": 4160, "sent_msgs": 3, "recv_bytes": 0, "recv_msgs": 0}
    assert "rank1" not in counters.snapshot()


def test_a_crowded_node_yields_for_less_long():
    assert shm.yield_window(2, 2) == shm.YIELD_S
    assert shm.yield_window(4, 2) == shm.CROWDED_YIELD_S < shm.YIELD_S


def test_a_rank_that_said_goodbye_is_not_named_for_the_one_waited_on():
    """Rank 1 closed the group on purpose (its goodbye is in ``live.gone``) before rank 2 froze
    or died: a shared-memory wait on rank 2 names rank 2, on both of its paths (the liveness
    check, and the deadline), as the socket path does. Both named rank 1, the earliest drop."""
    made = [shm.create(SLOT) for _ in range(3)]
    chan = shm.Channel(_Ep(0, 3), [mm for _, mm in made], ["a", "b", "c"], SLOT, 0.01)
    try:
        ep, now = chan.ep, time.monotonic()
        ep.live.left(1)
        ep.down.update({1: now - 3.0, 2: now - 2.0})
        with pytest.raises(PeerLost) as lost:
            shm.watch_peers(ep, [2], "all_reduce", 7, now)
        assert lost.value.rank == 2, lost.value
        del ep.down[2]  # rank 2 silent, its connection up: the deadline names it
        ep.timeout_s = 0.05
        with pytest.raises(PeerLost) as silent:
            chan._wait(lambda: [2], "all_reduce", 8)
        assert silent.value.rank == 2 and "did not reach" in str(silent.value), silent.value
    finally:
        chan.close()
        for fd, _ in made:
            shm.close_fd(fd)
