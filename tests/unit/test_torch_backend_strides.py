"""commrt's API over gloo (integrations/torch_backend.py) with non-contiguous tensors and arrays.

gloo reads and writes a tensor's storage from its first element as if it were contiguous: at 2
ranks, ``commrt.all_reduce(base[:, ::2])`` on the gloo backend summed the first 6 elements of
``base``'s storage, wrote them over the columns the view does not hold, and left half the view
unreduced (a broadcast likewise); the zmq backend was right. A fake ``torch.distributed`` that
does what gloo does (a second rank holding the same values) checks that every tensor handed to
torch is contiguous in effect: the results land in the view and nothing else changes."""
import numpy as np
import pytest
import torch

from commrt.collectives.reduce_ops import ReduceOp
from commrt.integrations import torch_backend


def _storage(t: torch.Tensor) -> torch.Tensor:
    """What gloo touches: numel elements of the storage from the tensor's offset."""
    return torch.as_strided(t, (t.numel(),), (1,), t.storage_offset())


class _Done:
    def wait(self, *_):
        return True

    def is_completed(self):
        return True


class _GlooLike:
    """A two-rank gloo whose peer holds the same values as this rank (rank 0)."""

    class ReduceOp:
        SUM, PRODUCT, MIN, MAX = "SUM", "PRODUCT", "MIN", "MAX"

    @staticmethod
    def all_reduce(t, op, group=None, async_op=False):
        if op == "SUM":
            _storage(t).mul_(2)
        return _Done() if async_op else None

    @staticmethod
    def broadcast(t, src, group=None, async_op=False):
        _storage(t).fill_(7)  # the root's values
        return _Done() if async_op else None

    @staticmethod
    def reduce(t, dst, op, group=None, async_op=False):
        return _GlooLike.all_reduce(t, op, group, async_op)

    @staticmethod
    def all_gather_into_tensor(out, inp, group=None, async_op=False):
        _storage(out).copy_(_storage(inp).repeat(2))
        return _Done() if async_op else None

    @staticmethod
    def reduce_scatter_tensor(out, inp, op, group=None, async_op=False):
        _storage(out).copy_(_storage(inp)[:out.numel()] * 2)
        return _Done() if async_op else None

    @staticmethod
    def irecv(t, src, group=None, tag=0):
        _storage(t).fill_(5)
        return _Done()


@pytest.fixture
def backend(monkeypatch):
    monkeypatch.setattr(torch_backend, "tdist", _GlooLike)
    monkeypatch.setattr(torch_backend, "_ALL_GATHER", _GlooLike.all_gather_into_tensor)
    monkeypatch.setattr(torch_backend, "_REDUCE_SCATTER", _GlooLike.reduce_scatter_tensor)
    monkeypatch.setattr(torch_backend, "_OPS", {op: op.name for op in ReduceOp if op.name != "AVG"}
                        | {ReduceOp.AVG: "SUM"})
    return torch_backend.TorchBackend("gloo", None, [0, 1], 0)


def _grid(kind: str):
    base = np.arange(24, dtype=np.float32).reshape(4, 6) + 1
    return base if kind == "numpy" else torch.from_numpy(base)


@pytest.mark.parametrize("kind", ["tensor", "numpy"])
@pytest.mark.parametrize("async_op", [False, True])
def test_in_place_ops_change_only_the_view(backend, kind, async_op):
    for name, call, want in (
            ("all_reduce", lambda v: backend.all_reduce(v, ReduceOp.SUM, async_op), lambda v: v * 2),
            ("all_reduce AVG", lambda v: backend.all_reduce(v, ReduceOp.AVG, async_op), lambda v: v),
            ("broadcast", lambda v: backend.broadcast(v, 1, async_op), lambda v: v * 0 + 7),
            ("reduce", lambda v: backend.reduce(v, 0, ReduceOp.SUM, async_op), lambda v: v * 2)):
        base = _grid(kind)
        before = torch.as_tensor(base).clone()
        work = call(base[:, ::2])
        if work is not None:
            work.wait()
        after = torch.as_tensor(base)
        assert torch.equal(after[:, ::2], want(before[:, ::2])), (name, after)
        assert torch.equal(after[:, 1::2], before[:, 1::2]), f"{name} wrote outside the view: {after}"


def test_gather_scatter_and_recv_with_strided_buffers(backend):
    out = torch.zeros(6, 3)
    backend.all_gather_into_tensor(out[:, 1], torch.arange(6.0)[::2])
    assert out[:, 1].tolist() == [0, 2, 4, 0, 2, 4] and out[:, [0, 2]].eq(0).all(), out
    out = torch.zeros(3, 2)
    backend.reduce_scatter_tensor(out[:, 0], torch.arange(12.0)[::2])
    assert out[:, 0].tolist() == [0, 4, 8] and out[:, 1].eq(0).all(), out
    buf = torch.zeros(3, 2)
    backend.irecv(buf[:, 1], 1).wait()
    assert buf[:, 1].tolist() == [5, 5, 5] and buf[:, 0].eq(0).all(), buf


@pytest.mark.parametrize("async_op", [False, True])
def test_numpy_arrays_with_negative_strides(backend, async_op):
    """torch has no negative strides: torch.from_numpy refused a reversed view (``a[::-1]``,
    which the zmq backend takes), so every op of the gloo backend on one raised ValueError.
    They run on a contiguous copy, stored back into the view."""
    for name, call, want in (
            ("all_reduce", lambda v: backend.all_reduce(v, ReduceOp.SUM, async_op), lambda v: v * 2),
            ("broadcast", lambda v: backend.broadcast(v, 1, async_op), lambda v: v * 0 + 7),
            ("reduce", lambda v: backend.reduce(v, 0, ReduceOp.SUM, async_op), lambda v: v * 2)):
        base = np.arange(12, dtype=np.float32) + 1
        before = base.copy()
        work = call(base[::-1])
        if work is not None:
            work.wait()
        assert np.array_equal(base, want(before)), (name, base)
    out = np.zeros(12, np.float32)
    backend.all_gather_into_tensor(out[::-1], np.arange(6, dtype=np.float32)[::-1])
    assert out[::-1].tolist() == [5, 4, 3, 2, 1, 0] * 2, out
    out = np.zeros(3, np.float32)
    backend.reduce_scatter_tensor(out[::-1], np.arange(6, dtype=np.float32)[::-1])
    assert out[::-1].tolist() == [10, 8, 6], out
    buf = np.zeros(4, np.float32)
    backend.irecv(buf[::-2], 1).wait()
    assert buf.tolist() == [0, 5, 0, 5], buf
