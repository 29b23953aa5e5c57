"""The CUDA staging plan (backends/staging.py) as pure functions, without a GPU: which element
ranges become pieces, and that the step order overlaps each exchange with the next piece's
device-to-host copy and the previous piece's host-to-device copy. The staged all_reduce itself
runs in tests/multirank/test_cuda.py and tests/gpu/staging_timing.py (``cuda``)."""
from types import SimpleNamespace

import pytest
import torch

from commrt.backends import staging
from commrt.backends.staging import TARGET_PIECES, piece_bounds, schedule
from commrt.backends.zmq_backend import ZmqBackend
from commrt.collectives.reduce_ops import ReduceOp, finish_avg_

MiB = 1 << 20


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
@pytest.mark.parametrize("nbytes", [0, 1, 8, MiB - 8, MiB, 4 * MiB + 8, 16 * MiB, 64 * MiB, 1 << 30])
def test_pieces_cover_the_tensor_in_order_within_the_size_limits(nbytes, itemsize):
    numel = nbytes // itemsize
    bounds = piece_bounds(numel, itemsize, 16 * MiB)
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a1 == b0 for (_, b0), (a1, _) in zip(bounds, bounds[1:]))  # contiguous, no overlap
    assert all(b - a <= 16 * MiB // itemsize for a, b in bounds)
    if numel:
        assert all(b > a for a, b in bounds)
        assert all((b - a) * itemsize >= MiB for a, b in bounds[:-1])  # only the last may be short


def test_piece_counts_pipeline_from_a_few_mib_and_grow_past_the_largest_piece():
    count = lambda nbytes: len(piece_bounds(nbytes // 4, 4, 16 * MiB))
    assert count(MiB) == 1  # one piece: each piece is a collective with its own latency
    assert count(4 * MiB) == TARGET_PIECES
    assert count(16 * MiB) == TARGET_PIECES
    assert count(64 * MiB) == TARGET_PIECES
    assert count(1 << 30) == 64  # capped at 16 MiB a piece
    assert len(piece_bounds(MiB // 4, 4, 16 * MiB, min_piece_bytes=256 << 10)) == TARGET_PIECES


@pytest.mark.parametrize("pieces", [1, 2, 3, 4, 9])
def test_each_exchange_overlaps_the_next_d2h_and_the_previous_h2d(pieces):
    events = []  # the order the host issues things in, after piece 0's D2H in the constructor
    for d2h, ex, h2d in schedule(pieces):
        events += [("d2h", d2h)] if d2h is not None else []
        events += [("ex", ex), ("h2d", h2d)]
    events = [("d2h", 0)] + events
    for kind in ("d2h", "ex", "h2d"):
        assert [i for k, i in events if k == kind] == list(range(pieces)), kind  # each once, in order
    at = {e: n for n, e in enumerate(events)}
    for k in range(pieces):
        assert at[("d2h", k)] < at[("ex", k)] < at[("h2d", k)]  # data dependencies
        if k + 1 < pieces:  # queued before exchange k, so it runs during it
            assert at[("d2h", k + 1)] < at[("ex", k)]
            assert at[("ex", k + 1)] > at[("h2d", k)]  # H2D of k runs during exchange k + 1


class _SaysCuda(torch.Tensor):
    """A CPU tensor that reports itself on CUDA: what ZmqBackend.all_reduce branches on."""

    @property
    def is_cuda(self):
        return True


class _StagedOnCpu:
    """staging.Staged without a GPU: the whole tensor as one host piece, in place."""

    def __init__(self, t, piece_bytes):
        self.t = t

    def run(self, collective):
        collective(self.t.as_subclass(torch.Tensor).view(-1))


def test_integer_avg_of_a_cuda_tensor_sums_in_64_bits(monkeypatch):
    """int8 100 AVG over 3 ranks is 100, on a CUDA tensor as on a CPU one: the staged pieces were
    reduced in int8 (300 wrapped to 44, averaged to 14) and sent as int8, where a CPU rank sends
    int64 (backends.base.widened). Three ranks of equal inputs: the sum is 3 x the own values,
    computed in the dtype the backend hands its algorithm."""
    monkeypatch.setattr(staging, "Staged", _StagedOnCpu)
    wire = []

    def all_reduce(ctx, buf, op):
        wire.append(buf.dtype)
        buf.copy_(buf * 3)  # what 3 equal ranks' SUM gives in this dtype (int8 wraps)
        finish_avg_(buf, 3)

    def collective(coll, dtype, count, body, async_op, writeback=None, **kw):
        body(None)
        if writeback is not None:
            writeback()
    stub = SimpleNamespace(_ops=SimpleNamespace(all_reduce=all_reduce), _collective=collective,
                           cfg=SimpleNamespace(comm=SimpleNamespace(chunk_bytes=1 << 20)))
    for dtype in (torch.int8, torch.uint8, torch.int32):
        t = torch.full((5,), 100, dtype=dtype).as_subclass(_SaysCuda)
        ZmqBackend.all_reduce(stub, t, ReduceOp.AVG)
        assert torch.equal(t.as_subclass(torch.Tensor), torch.full((5,), 100, dtype=dtype)), (dtype, t)
        assert wire[-1] == torch.int64, (dtype, wire[-1])  # the wire's dtype, as a CPU rank's
    ZmqBackend.all_reduce(stub, torch.full((5,), 1.5).as_subclass(_SaysCuda), ReduceOp.AVG)
    assert wire[-1] == torch.float32  # floats: staged in pieces as before
