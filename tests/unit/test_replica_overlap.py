"""replica_overlap.Overlap without sockets: a stand-in backend whose all-reduce sums 3 identical
replicas (x3) checks that the buckets started from the gradient hooks cover every parameter once
(in one order on every replica), that ``p.grad`` keeps the replica's own gradient (a redo needs it), that the views map each
parameter to its gradient's place, and that a failure inside a hook is reported by ``finish``,
not raised into backward."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from commrt.runtime.errors import ConfigError, PeerLost
from commrt.train import replica_overlap
from commrt.train.replica_overlap import Overlap
from tests.multirank.programs.replica_ft_job import Twin, twin_backward


class Done:
    def wait(self, timeout=None):
        return True


class Triple:
    """Sums 3 replicas holding the same gradient; counts the all-reduces started."""

    def __init__(self, fail_at: int | None = None):
        self.calls, self.fail_at = 0, fail_at

    def all_reduce(self, tensor, op, async_op):
        self.calls += 1
        if self.calls == self.fail_at:
            raise PeerLost(2, "all_reduce", 7, "process ended")
        tensor.mul_(3)
        return Done()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 300), nn.Tanh(), nn.Linear(300, 300), nn.Tanh(), nn.Linear(300, 2))


def _backward(model: nn.Module) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    model(x).pow(2).sum().backward()


def test_buckets_start_in_backward_and_leave_the_gradients(monkeypatch):
    monkeypatch.setattr(replica_overlap, "FIRST_ELEMS", 1000)  # several buckets for a small model
    monkeypatch.setattr(replica_overlap, "CAP_ELEMS", 40000)
    model = _model()
    params = list(model.parameters())
    ov, backend = Overlap(params, 5.0), Triple()
    assert len(ov.spans) >= 3
    ov.arm(backend)
    _backward(model)
    assert backend.calls == len(ov.spans), "every bucket's all-reduce starts from a hook, during backward"
    assert ov.started and ov.finish() is None
    own = [p.grad.clone() for p in params]
    for p, view in ov.views():
        torch.testing.assert_close(view, 3 * p.grad, rtol=0, atol=0)
    for p, g in zip(params, own):
        assert torch.equal(p.grad, g), "p.grad must keep this replica's gradient until the step commits"
    # the plain path fills the same buffer in the same order
    ov.fill(True)
    for p, view in ov.views():
        assert torch.equal(view, p.grad)
    assert ov.fill(False).abs().sum() == 0


def test_a_failure_in_a_hook_is_reported_by_finish(monkeypatch):
    monkeypatch.setattr(replica_overlap, "FIRST_ELEMS", 1000)
    monkeypatch.setattr(replica_overlap, "CAP_ELEMS", 40000)
    model = _model()
    ov = Overlap(list(model.parameters()), 5.0)
    ov.arm(Triple(fail_at=1))
    _backward(model)  # does not raise
    err = ov.finish()
    assert isinstance(err, PeerLost) and err.rank == 2


def test_disarmed_hooks_do_nothing():
    model = _model()
    ov, backend = Overlap(list(model.parameters()), 5.0), Triple()
    _backward(model)
    assert backend.calls == 0 and not ov.started


class Recorder:
    """Records where in the flat buffer each all-reduce starts."""

    def __init__(self, flat: torch.Tensor):
        self.flat, self.started = flat, []

    def all_reduce(self, tensor, op, async_op):
        self.started.append((tensor.data_ptr() - self.flat.data_ptr()) // tensor.element_size())
        return Done()


def _order(replica: int) -> list[int]:
    model = Twin()
    ov = Overlap(list(model.parameters()), 1.0)
    backend = Recorder(ov.flat)
    ov.arm(backend)
    twin_backward(model, replica, 0)
    assert ov.finish() is None
    return backend.started


def test_buckets_start_in_one_order_when_a_parameter_is_unused_on_one_replica():
    """Twin's two buckets have the same size; replica 1's forward leaves ``b`` out, so b's bucket
    (the first) fills there only in finish. Starting a's bucket first there summed it with
    replica 0's b bucket, without an error (tests/multirank/test_replica_ft.py: the average)."""
    assert _order(0) == _order(1) == [0, 600 * 600]


def test_two_backwards_in_one_step_are_refused_not_averaged_in_part(monkeypatch):
    """overlap=True takes one backward per step: a second one's gradients came after their
    buckets went out (the average would lack them); finish says so instead."""
    monkeypatch.setattr(replica_overlap, "FIRST_ELEMS", 1000)
    monkeypatch.setattr(replica_overlap, "CAP_ELEMS", 40000)
    model = _model()
    ov = Overlap(list(model.parameters()), 5.0)
    ov.arm(Triple())
    _backward(model)
    _backward(model)
    with pytest.raises(ConfigError, match="second gradient in one step .*overlap=False"):
        ov.finish()
    ov.arm(Triple())  # the next step, with one backward, is fine
    model.zero_grad(set_to_none=True)
    _backward(model)
    assert ov.finish() is None


class Double(Triple):
    """Sums 2 replicas holding the same gradient: x2 then /2 is exact in every dtype."""

    def all_reduce(self, tensor, op, async_op):
        tensor.mul_(2)
        return Done()


class Typed(nn.Module):
    """Parameters of the given dtypes (a bf16 or float64 model, or one mixing them)."""

    def __init__(self, dtypes):
        super().__init__()
        self.ps = nn.ParameterList(nn.Parameter(torch.randn(5, generator=torch.Generator().manual_seed(i)).to(d))
                                   for i, d in enumerate(dtypes))

    def loss(self):
        return sum((p.float() * torch.arange(1.0, 6.0)).pow(2).sum() for p in self.ps)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("dtypes", [[torch.bfloat16] * 2, [torch.float64] * 2, [torch.float32, torch.bfloat16]],
                         ids=["bf16", "float64", "mixed"])
def test_a_model_not_in_float32_steps_as_a_plain_torch_loop(overlap, dtypes):
    """The buffer the gradients are averaged in was float32 (overlap) or whatever torch.cat made
    of the parameters' dtypes, and ``p.grad`` was set to a view of it: a bf16 or float64
    parameter refused it ("attempting to assign a gradient with dtype 'float' ..."), at the
    first step of a job with the default overlap; a bf16 model summed in bf16 otherwise."""
    model, plain = Typed(dtypes), Typed(dtypes)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    want = torch.optim.AdamW(plain.parameters(), lr=0.1)
    grads = replica_overlap.Replicated(list(model.parameters()), opt, overlap, 5.0)
    backend = Double()
    for _ in range(2):
        grads.arm(backend)
        model.loss().backward()
        if grads.overlapped():
            flat, exc = grads.finish()
            assert exc is None
        else:
            flat = grads.flat(True)
            backend.all_reduce(flat, None, False)
        grads.apply(flat, 2)  # the average of 2 replicas with the same gradient
        plain.loss().backward()
        want.step()
        want.zero_grad(set_to_none=True)
    for p, q in zip(model.parameters(), plain.parameters()):
        assert p.dtype == q.dtype and torch.equal(p, q), (p, q)
