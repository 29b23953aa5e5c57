"""Cutting an nn.Sequential into stages (no processes)."""
import pytest
import torch
from torch import nn

from commrt.runtime.errors import ConfigError
from commrt.pipeline import split
from commrt.pipeline.stage import split_points


def test_by_layers_evens_the_layer_counts_and_keeps_order():
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(7)])
    for n in range(1, 8):
        parts = split(model, n)
        sizes = [len(p) for p in parts]
        assert sum(sizes) == 7 and max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
        assert [m for p in parts for m in p] == list(model)


def test_by_params_balances_parameters_not_layers():
    model = nn.Sequential(nn.Linear(100, 100), nn.Tanh(), nn.Tanh(), nn.Tanh(), nn.Linear(10, 10))
    assert [len(p) for p in split(model, 2, by="params")] == [1, 4]
    assert [len(p) for p in split(model, 2)] == [2, 3]


def test_every_stage_gets_a_layer_even_when_one_layer_dominates():
    assert split_points([1, 1000, 1, 1], 4) == [0, 1, 2, 3, 4]
    assert split_points([1000, 1, 1, 1], 2) == [0, 1, 4]


def test_bad_requests_are_config_errors():
    with pytest.raises(ConfigError, match="cannot split 2 layers into 3"):
        split(nn.Sequential(nn.Tanh(), nn.Tanh()), 3)
    with pytest.raises(ConfigError, match="valid: \\['layers', 'params', 'time'\\]"):
        split(nn.Sequential(nn.Tanh()), 1, by="flops")
    with pytest.raises(ConfigError, match="nn.Sequential"):
        split(nn.Linear(1, 1), 1)


class _Heavy(nn.Module):
    """No parameters, most of the time: a parameter count cannot see it."""

    def __init__(self):
        super().__init__()
        self.register_buffer("w", torch.randn(64, 64) / 8)

    def forward(self, x):
        for _ in range(60):
            x = torch.tanh(x @ self.w)
        return x


def test_a_time_split_follows_measured_cost_not_parameters():
    torch.manual_seed(0)
    model = nn.Sequential(_Heavy(), nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64))
    sample = torch.randn(256, 64)
    assert [len(p) for p in split(model, 2, by="params")] == [2, 2]
    assert [len(p) for p in split(model, 2, by="time", sample=sample)] == [1, 3]
    assert all(p.grad is None for p in model.parameters())  # timing leaves no gradients behind
    with pytest.raises(ConfigError, match="needs a sample"):
        split(model, 2, by="time")


def test_several_stages_on_a_group_of_one_rank_are_a_config_error(monkeypatch):
    """Every transfer would be to the rank itself, which the transports refuse mid-step
    ('recv: peer rank 0 is invalid (rank 0 of 1)'); one stage on one rank sends nothing."""
    from commrt.pipeline import stage as st

    class Group:
        ranks = [0]
    monkeypatch.setattr(st.dist, "get_world_group", lambda: Group())
    monkeypatch.setattr(st.dist, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(st.dist, "get_rank", lambda group=None: 0)
    st.PipelineStage(nn.Linear(2, 2), 0, 1)
    with pytest.raises(ConfigError, match="2 stages on a group of 1 rank would send to itself"):
        st.PipelineStage(nn.Linear(2, 2), 1, 2)


def test_a_time_split_leaves_the_model_and_the_random_stream_as_they_were():
    """Timing runs the layers forward and backward: BatchNorm's running statistics moved four
    times and dropout drew four masks, so training after split(by="time") differed from the same
    model trained in one process."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2))
    sample = torch.randn(6, 4)
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    rng = torch.get_rng_state()
    split(model, 2, by="time", sample=sample)
    assert all(torch.equal(v, buffers[k]) for k, v in model.named_buffers()), dict(model.named_buffers())
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())


def test_a_time_split_times_layers_that_modify_their_input_in_place_and_leaves_the_sample_as_it_was():
    """Each layer was timed on a leaf that requires grad, so an nn.ReLU(inplace=True) (in a
    pipeline stage, which runtime.py runs as one process would) made split(by="time") raise
    torch's 'a leaf Variable that requires grad is being used in an in-place operation'; and a
    first layer in place would have changed the caller's sample."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 2))
    sample = torch.randn(6, 4)
    kept = sample.clone()
    parts = split(model, 2, by="time", sample=sample, loss_fn=nn.functional.mse_loss, target=torch.zeros(6, 2))
    assert [m for p in parts for m in p] == list(model)
    assert torch.equal(sample, kept)
    assert all(p.grad is None for p in model.parameters())
