"""``commrt bench``'s result check (bench/cases.py, runner.measure / measure_alone): the checked
run's own output is what is compared, not what an earlier run left there. Pure: rank 0 of a
2-rank world played by a fake backend that knows rank 1's input (cases.pattern)."""
from types import SimpleNamespace

import pytest
import torch

from commrt.bench import runner
from commrt.bench.quant import QuantBackend
from commrt.bench.cases import pattern
from commrt.collectives.reduce_ops import ReduceOp


class _Done:
    def wait(self):
        return None


class _WritesOnce:
    """Rank 0 of 2: each collective writes the right result on its first call, then nothing (an
    op that stopped delivering: the check has to see that)."""

    name, size, rank = "zmq", 2, 0

    def __init__(self):
        self.calls = 0

    def _once(self) -> bool:
        self.calls += 1
        return self.calls == 1

    def barrier(self, async_op=False):
        return None

    def all_reduce(self, t, op, async_op=False):  # the bench's timing and #wrong sums: rank 0's own
        return None

    def all_gather_into_tensor(self, out, inp, async_op=False):
        if self._once():
            out.copy_(torch.cat([inp, pattern(out.numel(), 1, out.dtype, ReduceOp.SUM)[:inp.numel()]]))

    def reduce_scatter_tensor(self, out, inp, op, async_op=False):
        if self._once():
            m = out.numel()
            out.copy_(inp[:m] + pattern(inp.numel(), 1, inp.dtype, op)[:m])

    def all_to_all_single(self, out, inp, out_splits, in_splits, async_op=False):
        if self._once():
            m = out.numel() // 2
            out.copy_(torch.cat([inp[:m], pattern(inp.numel(), 1, inp.dtype, ReduceOp.SUM)[:m]]))

    def isend(self, t, dst, tag):
        return _Done()

    def irecv(self, t, src, tag):
        if self._once():
            t.copy_(pattern(t.numel(), src, t.dtype, ReduceOp.SUM))
        return _Done()


COLLECTIVES = ["all_gather", "reduce_scatter", "all_to_all", "sendrecv"]


@pytest.mark.parametrize("coll", COLLECTIVES)
def test_the_fake_is_right_on_its_first_call(coll):
    case = runner.make_case(coll, _WritesOnce(), 64, torch.float32, ReduceOp.SUM)
    case.run()
    assert runner._wrong(_WritesOnce(), case) == 0


@pytest.mark.parametrize("coll", COLLECTIVES)
def test_a_back_to_back_run_checks_the_checked_runs_own_output(coll):
    # the output buffer kept the first run's (right) result: an op that then wrote nothing
    # was reported with 0 wrong elements
    row = runner.measure(coll, _WritesOnce(), 64, torch.float32, ReduceOp.SUM, iters=1, warmup=0)
    assert row["wrong"] > 0


@pytest.mark.parametrize("coll", COLLECTIVES)
def test_an_op_by_op_run_checks_the_checked_runs_own_output(coll):
    rows = runner.measure_alone(coll, {"zmq": _WritesOnce()}, 64, torch.float32, ReduceOp.SUM, samples=2, warmup=0)
    assert rows["zmq"]["wrong"] > 0


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_quantized_column_counts_nan_and_inf_as_wrong(mode):
    # err > bound is False for NaN: a quantized op that produced NaN (or left the poisoned
    # output) passed with #wrong 0
    be = QuantBackend(SimpleNamespace(world=SimpleNamespace(backend=SimpleNamespace(name="zmq", size=2, rank=0))), mode)
    expected = torch.arange(8, dtype=torch.float32)
    got = expected.clone()
    assert be.count_wrong(got, expected) == 0
    got[1], got[2] = float("nan"), float("inf")
    assert be.count_wrong(got, expected) == 2
    assert be.max_abs_error == float("inf")  # max(0.0, nan) was 0.0: the summary hid it


@pytest.mark.parametrize("name", ["nccl", "nccl+hier", "nccl+int8", "nccl+int4"])
def test_every_nccl_column_works_on_the_gpu(name, monkeypatch):
    # device_of compared the name with "nccl": the +hier and quantized columns over NCCL got CPU
    # tensors (torch's NCCL group takes CUDA tensors only) and no CUDA sync in their timing
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert runner.device_of(SimpleNamespace(name=name)) == torch.device("cuda", 0)
    assert runner.device_of(SimpleNamespace(name=name.replace("nccl", "gloo"))) == torch.device("cpu")
