"""The pipeline runtime's per-rank pieces that need no peer: the backward's check of the received
gradients, and step()'s error handling (issue 30 items 19 and 20)."""
import pytest
import torch

from commrt.pipeline import runtime
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
