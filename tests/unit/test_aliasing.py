"""One set of aliasing rules for both paths (issue 28.3): the decisions, the wrapper that
applies them in front of ops.py and shm_ops.py, and the step contract both contexts share."""
import inspect
import pathlib
import types

import pytest
import torch

from commrt.collectives import aliasing, ops, shm_ops
from commrt.collectives.context import OpContext
from commrt.collectives.contract import Algorithms, StepContext
from commrt.collectives.reduce_ops import ReduceOp
from commrt.runtime.dtypes import overlaps
from commrt.transport.wire import Coll

M, N = 4, 3  # elements per rank, ranks


def test_reduce_scatter_in_place_only_for_the_ranks_own_slice():
    inp = torch.zeros(N * M)
    for rank in range(N):
        own = inp[rank * M:(rank + 1) * M]
        assert aliasing.reduce_scatter_in_place(own, inp, rank)
        assert not aliasing.reduce_scatter_needs_temporary(own, inp, rank)
        other = inp[((rank + 1) % N) * M:][:M]
        assert not aliasing.reduce_scatter_in_place(other, inp, rank)
        assert aliasing.reduce_scatter_needs_temporary(other, inp, rank)
    assert aliasing.reduce_scatter_needs_temporary(inp[1:M + 1], inp, 0)  # shifted by one
    assert not aliasing.reduce_scatter_needs_temporary(torch.zeros(M), inp, 0)  # disjoint


def test_all_gather_copies_an_input_only_when_received_blocks_could_clobber_it():
    out = torch.arange(N * M, dtype=torch.float32)
    own = out[M:2 * M]
    assert aliasing.all_gather_source(out, own, 1) is own  # the in-place form
    disjoint = torch.ones(M)
    assert aliasing.all_gather_source(out, disjoint, 1) is disjoint
    other = out[:M]  # rank 1's input is rank 0's block of the output
    got = aliasing.all_gather_source(out, other, 1)
    assert not overlaps(got, out) and torch.equal(got, other)


def test_all_to_all_copies_an_overlapping_input():
    t = torch.arange(6.0)
    assert not overlaps(aliasing.all_to_all_source(t, t), t)
    assert not overlaps(aliasing.all_to_all_source(t[:3], t[2:]), t)
    other = torch.zeros(6)
    assert aliasing.all_to_all_source(t, other) is other


@pytest.mark.parametrize("position", range(4))
def test_own_part_may_be_the_output_only_as_first_or_second_part(position):
    out = torch.zeros(M)
    got = aliasing.own_part(out, out, position)
    assert (got is out) == (position <= 1)
    shifted = torch.zeros(M + 1)
    assert not overlaps(aliasing.own_part(shifted[1:], shifted[:M], position), shifted[:M])
    apart = torch.zeros(M)
    assert aliasing.own_part(apart, out, position) is apart


class _Recorder:
    """An Algorithms that records what it was given and fills its output with 7s."""

    def __init__(self):
        self.calls = []

    def reduce_scatter(self, ctx, out, inp, op):
        self.calls.append((out, inp))
        out.fill_(7)

    def all_gather(self, ctx, out, inp):
        self.calls.append((out, inp))

    def all_to_all(self, ctx, out, inp, out_bounds, in_bounds):
        self.calls.append((out, inp))


def _disjoint_or_in_place(out, inp, rank, in_place):
    return not overlaps(out, inp) or in_place(out, inp, rank)


@pytest.mark.parametrize("rank", range(N))
def test_the_algorithms_only_ever_see_disjoint_or_in_place_buffers(rank):
    rec, ctx = _Recorder(), types.SimpleNamespace(rank=rank)
    wrapped = aliasing.Aliased(rec)
    for start in range(0, N * M - M + 1):  # every placement of the output inside the input
        buf = torch.zeros(N * M)
        wrapped.reduce_scatter(ctx, buf[start:start + M], buf, ReduceOp.SUM)
        out, inp = rec.calls[-1]
        assert _disjoint_or_in_place(out, inp, rank, aliasing.reduce_scatter_in_place), start
        assert torch.equal(buf[start:start + M], torch.full((M,), 7.0))  # the result reached out
        buf = torch.zeros(N * M)
        wrapped.all_gather(ctx, buf, buf[start:start + M])
        out, inp = rec.calls[-1]
        assert _disjoint_or_in_place(out, inp, rank, aliasing.all_gather_in_place), start
        wrapped.all_to_all(ctx, buf, buf[start:], [], [])
        assert not overlaps(*rec.calls[-1])


def test_both_contexts_implement_the_step_contract():
    tcp = OpContext(object(), 0, 1, 2, 9, Coll.ALL_REDUCE, torch.float32, 5, 1 << 16, 1 << 12, 3,
                    ReduceOp.MAX, 0)
    chan = types.SimpleNamespace(slot_bytes=1 << 12)
    shm = shm_ops.ShmContext(chan, 0, 1, 2, 9, Coll.ALL_REDUCE, torch.float32, 5, 3, ReduceOp.MAX, 0, 1 << 12)
    assert isinstance(tcp, StepContext) and isinstance(shm, StepContext)
    assert tcp.header(8, 2, 0) == shm.header(8, 2, 0)  # one op, one identity on the wire and in errors


def test_both_algorithm_modules_implement_the_same_signatures():
    for name, member in inspect.getmembers(Algorithms, inspect.isfunction):
        if name.startswith("_"):
            continue
        want = list(inspect.signature(member).parameters)[1:]  # without self
        for module in (ops, shm_ops):
            assert list(inspect.signature(getattr(module, name)).parameters) == want, (module.__name__, name)


def test_no_aliasing_rule_outside_aliasing_py():
    """The rules live in one module: an overlap test or an input copy elsewhere in
    collectives/ is a second copy of them, which is where the wrong in-place reduce_scatter lived."""
    root = pathlib.Path(aliasing.__file__).parent
    for path in root.glob("*.py"):
        if path.name == "aliasing.py":
            continue
        text = path.read_text()
        assert "overlaps(" not in text and ".clone()" not in text, path.name
