"""The pipeline runtime's per-rank pieces that need no peer: the backward's check of the received
gradients, and step()'s error handling (issue 30 items 19 and 20)."""
import pytest
import torch

from commrt.pipeline.runtime import GPipe, OneFOneB, PipelineSchedule, _Slot
from commrt.runtime.errors import CommError, ConfigError, ProtocolError


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


def _middle_stage_schedule(monkeypatch, run):
    """Stage 1 of 3 (no inputs, no target), no receives; ``run(sched, action)`` is each action."""
    sched = PipelineSchedule.__new__(PipelineSchedule)
    sched._chan, sched._failed = _NoChannels(), None
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


def test_no_step_runs_after_a_failed_one(monkeypatch):
    """The failed step's receives stay posted and its messages in flight: a later step took them
    for its own ('expected micro-batch 0 from stage 0, got stage 0 micro-batch 1' with real ranks)."""
    ran = []

    def run(sched, a):
        ran.append(a)
        raise ValueError("the stage's forward failed")
    sched = _middle_stage_schedule(monkeypatch, run)
    with pytest.raises(ValueError):
        sched.step()
    with pytest.raises(CommError, match=r"an earlier step failed \(ValueError\(\"the stage's forward failed"
                                        r"\"\)\).*new group"):
        sched.step()
    assert len(ran) == 1


def test_a_failing_send_alone_is_still_raised_and_no_step_runs_after_it(monkeypatch):
    """A step whose only error is a send failing at its wait (its reader went away) is a failed
    step too: its messages may still be in flight. The next step ran."""
    sched = _middle_stage_schedule(monkeypatch, lambda s, a: s._sends.append(_FailingSend()))
    with pytest.raises(ProtocolError, match="peer closed"):
        sched.step()
    with pytest.raises(CommError, match=r"an earlier step failed \(ProtocolError"):
        sched.step()


def _first_stage_schedule(module, num_microbatches=2):
    """Stage 0 of 2, as step() leaves it before its first action."""
    sched = PipelineSchedule.__new__(PipelineSchedule)
    sched.stages, sched.num_stages, sched.num_microbatches, sched._batches = {0: _Stage(module)}, 2, num_microbatches, 1
    sched._slots, sched.peak_in_flight, sched._copy_inputs = {}, {0: 0}, False
    return sched


@pytest.mark.parametrize("tensors,shapes", [
    ((torch.ones(8, 3), torch.ones(6, 3)), r"\[\(8, 3\), \(6, 3\)\]"),  # the mask was cut at other rows
    ((torch.ones(8, 3), torch.tensor(2.0)), r"\[\(8, 3\), \(\)\]"),  # a scalar has no rows to cut
])
def test_step_inputs_with_different_rows_are_a_config_error(tensors, shapes):
    """A second input of other rows was cut silently: micro-batch i of x went with rows of the
    other tensor that belong to micro-batch j."""
    sched = _first_stage_schedule(torch.nn.Identity())
    with pytest.raises(ConfigError, match=r"inputs: every tensor needs the same number of rows .*" + shapes):
        sched._chunks(tensors, 0, "inputs")


@pytest.mark.parametrize("bad,kind", [(None, "NoneType"), (3, "int")])
def test_a_stage_output_that_is_not_a_tensor_is_a_config_error_naming_stage_and_micro_batch(bad, kind):
    """It failed later, in the send, as an AttributeError ('NoneType' object has no attribute 'detach')."""
    sched = _first_stage_schedule(lambda x: (x * 2, bad))
    sched._inputs = sched._chunks((torch.ones(4, 3),), 0, "inputs")
    with pytest.raises(ConfigError, match=rf"stage 0, micro-batch 1: output 1 is {kind}, not a tensor"):
        sched._forward(0, 1)


def test_a_schedule_holding_the_last_stage_needs_a_loss_fn(monkeypatch):
    """Without one, the first forward of the last stage failed with 'NoneType' object is not callable."""
    from commrt.pipeline import runtime, schedules
    monkeypatch.setattr(runtime.dist, "get_rank", lambda group=None: 1)

    class Stage:
        stage_index, num_stages, group, group_size, module = 1, 2, None, 2, torch.nn.Identity()
    with pytest.raises(ConfigError, match="stage 1 is the last: its schedule needs a loss_fn"):
        PipelineSchedule([Stage()], 2, None, schedules.gpipe_actions(2, 2))


def test_a_last_stage_returning_a_scalar_per_micro_batch_returns_them_stacked(monkeypatch):
    """A last stage that computes its own loss (loss_fn passes it on) returns a 0-dim tensor per
    micro-batch; step() trained, then failed in torch.cat ('zero-dimensional tensor ... cannot
    be concatenated') after every gradient was in."""
    from commrt.pipeline import runtime, schedules
    monkeypatch.setattr(runtime.dist, "get_rank", lambda group=None: 0)
    model = torch.nn.Linear(3, 1)

    class Stage:
        stage_index, num_stages, group, group_size = 0, 1, None, 1
        module = staticmethod(lambda x, model=model: model(x).pow(2).mean())

        def rank_of(self, stage):
            return 0
    sched = PipelineSchedule([Stage()], 2, lambda out, target: out, schedules.gpipe_actions(1, 2))
    x = torch.arange(12.0).reshape(4, 3)
    out = sched.step(x, target=torch.zeros(4))
    want = torch.stack([model(x[:2]).pow(2).mean(), model(x[2:]).pow(2).mean()]).detach()
    assert out.shape == (2,) and torch.allclose(out, want), (out, want)
    assert model.weight.grad is not None


class _OneStage:
    stage_index, num_stages, group, group_size, module = 0, 1, None, 1, torch.nn.Identity()


@pytest.mark.parametrize("make", [lambda: GPipe, lambda: OneFOneB])
@pytest.mark.parametrize("count", [0, -1])
def test_a_micro_batch_count_below_one_is_a_config_error(make, count):
    """It was a bare ValueError from the schedule's builder."""
    with pytest.raises(ConfigError, match="num_microbatches >= 1"):
        make()(_OneStage(), count, torch.nn.functional.mse_loss)


def _single_stage(monkeypatch, module, loss_fn, m=2):
    """A one-stage schedule (first and last at once) on this process alone."""
    from commrt.pipeline import runtime, schedules
    monkeypatch.setattr(runtime.dist, "get_rank", lambda group=None: 0)

    class Stage:
        stage_index, num_stages, group, group_size = 0, 1, None, 1

        def rank_of(self, stage):
            return 0
    Stage.module = module
    return PipelineSchedule([Stage()], m, loss_fn, schedules.gpipe_actions(1, m))


@pytest.mark.parametrize("target,what", [((torch.ones(4, 2), torch.ones(4)), "target"), ([1.0, 2.0], "target")])
def test_a_target_or_input_that_is_not_a_tensor_is_a_config_error(monkeypatch, target, what):
    """step() failed with "'tuple' object has no attribute 'dim'" after posting its receives."""
    sched = _single_stage(monkeypatch, torch.nn.Linear(3, 2), torch.nn.functional.mse_loss)
    with pytest.raises(ConfigError, match=f"{what} must be a tensor"):
        sched.step(torch.ones(4, 3), target=target)
    sched = _single_stage(monkeypatch, torch.nn.Linear(3, 2), torch.nn.functional.mse_loss)
    with pytest.raises(ConfigError, match="input 1 must be a tensor"):
        sched.step(torch.ones(4, 3), None, target=torch.ones(4, 2))


def test_a_last_stage_returning_a_dict_trains_and_returns_its_outputs_per_micro_batch(monkeypatch):
    """A last stage returning a dict (as Hugging Face models do): loss_fn takes it as one process
    would; step() failed with "'dict' object has no attribute 'detach'" in the first forward."""
    lin = torch.nn.Linear(3, 2)
    module = staticmethod(lambda x: {"logits": lin(x), "aux": lin.weight.sum()})
    sched = _single_stage(monkeypatch, module, lambda out, y: torch.nn.functional.mse_loss(out["logits"], y))
    x, y = torch.arange(12.0).reshape(4, 3), torch.ones(4, 2)
    out = sched.step(x, target=y)
    ref = torch.nn.Linear(3, 2)
    ref.load_state_dict(lin.state_dict())
    torch.nn.functional.mse_loss(ref(x), y).backward()
    assert torch.allclose(lin.weight.grad, ref.weight.grad) and torch.allclose(lin.bias.grad, ref.bias.grad)
    assert isinstance(out, list) and len(out) == 2 and torch.equal(out[1]["logits"], lin(x[2:]).detach())
    assert not out[0]["logits"].requires_grad and not out[0]["aux"].requires_grad
