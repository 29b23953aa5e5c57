"""The pipeline runtime's per-rank pieces that need no peer: the backward's check of the received
gradients, and step()'s error handling (issue 30 items 19 and 20)."""
import pytest
import torch

from commrt.pipeline.runtime import PipelineSchedule, _Slot
from commrt.runtime.errors import ProtocolError


class _Stage:
    def __init__(self, module):
        self.module = module


def _schedule_with_slot(grads_out):
    """A schedule on stage 0 of 2 whose micro-batch 3 has run forward and received ``grads_out``."""
    module = torch.nn.Linear(4, 2)
    sched = PipelineSchedule.__new__(PipelineSchedule)
    sched.stages, sched._backwards_left = {0: _Stage(module)}, {0: 1}
    x = torch.ones(5, 4)
    sched._slots = {(0, 3): _Slot(inputs=[x], outputs=[module(x)], grads_out=grads_out)}
    return sched, module


@pytest.mark.parametrize("grads,shapes", [
    ([torch.ones(5, 3)], r"\[\(5, 3\)\], expected the outputs' \[\(5, 2\)\]"),  # dropped before
    ([torch.ones(10)], r"\[\(10,\)\], expected the outputs' \[\(5, 2\)\]"),  # same numel, other shape
    ([], r"\[\], expected"),  # zip() stopped at the shorter list
])
def test_a_gradient_of_the_wrong_shape_is_a_protocol_error_naming_stage_and_micro_batch(grads, shapes):
    sched, module = _schedule_with_slot(grads)
    with pytest.raises(ProtocolError, match=r"stage 0, micro-batch 3: gradients received from stage 1 have "
                                            r"shapes " + shapes):
        sched._backward(0, 3)
    assert module.weight.grad is None


def test_matching_and_empty_gradients_still_run_backward():
    sched, module = _schedule_with_slot([torch.ones(5, 2)])
    sched._backward(0, 3)
    assert module.weight.grad is not None and torch.equal(module.weight.grad, torch.full((2, 4), 5.0))
    sched, module = _schedule_with_slot([torch.empty(0)])  # the next stage did not use the output
    sched._backward(0, 3)
    assert module.weight.grad is None


class _FailingSend:
    def is_completed(self):
        return True

    def wait(self):
        raise ProtocolError("send to rank 2 failed: peer closed")


class _NoChannels:
    def begin(self, plan):
        pass

    def forget(self):
        pass


def _middle_stage_schedule(monkeypatch, run):
    """Stage 1 of 3 (no inputs, no target), no receives; ``run(sched, action)`` is each action."""
    sched = PipelineSchedule.__new__(PipelineSchedule)
    sched._chan = _NoChannels()
    sched.stages, sched.num_stages, sched.num_microbatches, sched.group = {1: None}, 3, 1, None
    sched._recv_plan, sched._send_plan, sched._backwards, sched.rank_actions = [], {}, {}, ["an action"]
    monkeypatch.setattr(sched, "_run", lambda a: run(sched, a), raising=False)
    return sched


def test_a_failing_send_does_not_replace_the_steps_original_error(monkeypatch):
    """issue 30 item 20: step()'s ``finally`` waited for the sends and raised their error in place
    of the one that stopped the step."""
    def run(sched, a):
        sched._sends.append(_FailingSend())
        raise ValueError("the stage's forward failed")
    sched = _middle_stage_schedule(monkeypatch, run)
    with pytest.raises(ValueError, match="the stage's forward failed") as info:
        sched.step()
    assert any("a pipeline send also failed" in n and "peer closed" in n for n in info.value.__notes__)


def test_a_failing_send_alone_is_still_raised(monkeypatch):
    sched = _middle_stage_schedule(monkeypatch, lambda s, a: s._sends.append(_FailingSend()))
    with pytest.raises(ProtocolError, match="peer closed"):
        sched.step()
