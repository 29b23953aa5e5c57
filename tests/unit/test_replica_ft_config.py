"""[train] fault_tolerance: the valid values, the ZeRO setups replica mode refuses, and the replica
groups HYBRID_SHARD / MiCS / hpZ map to (issue 33.2)."""
from __future__ import annotations

import socket

import pytest
import torch

from commrt.launch import free_port
from commrt.runtime.errors import ConfigError
from commrt.train.config import TrainConfig
from commrt.runtime.config import load_config
from commrt.train.replica_ft import ReplicaFT, serve
from commrt.train.replica_group import group_size, layout
from commrt.train import replica_state
from commrt.train.replica_state import make_optimizer
from commrt.optim.rules import OptimSpec


def test_off_by_default_and_replica_at_stage_0():
    assert TrainConfig.from_dict({}).fault_tolerance == "off"
    cfg = TrainConfig.from_dict({"fault_tolerance": "replica", "zero_optimization": {"sharding_strategy": "NO_SHARD"}})
    assert cfg.fault_tolerance == "replica" and cfg.zero.stage == 0


def test_unknown_value_names_the_valid_ones():
    with pytest.raises(ConfigError, match=r"fault_tolerance = 'replicas' is invalid; valid: \['off', 'replica'\]"):
        TrainConfig.from_dict({"fault_tolerance": "replicas"})


@pytest.mark.parametrize("zero, why", [
    ({"stage": 1}, "needs zero_optimization.stage 0 .*or replica groups.*stage 1 shards"),
    ({"stage": 3}, "needs zero_optimization.stage 0 .*stage 3 shards"),
    ({"sharding_strategy": "FULL_SHARD"}, "stage 3 shards it across all the ranks"),
    ({"sharding_strategy": "HYBRID_SHARD", "zero_quantized_gradients": True}, "zero_quantized_gradients are not"),
    ({"stage": 0, "zero_quantized_gradients": True}, "not supported with it"),
])
def test_sharded_stages_are_refused(zero, why):
    with pytest.raises(ConfigError, match=why):
        TrainConfig.from_dict({"fault_tolerance": "replica", "zero_optimization": zero})


@pytest.mark.parametrize("zero, node, size", [
    ({"sharding_strategy": "NO_SHARD"}, 4, 1),
    ({"sharding_strategy": "HYBRID_SHARD"}, 4, 4),  # the ranks per node
    ({"sharding_strategy": "HYBRID_SHARD", "shard_group_size": 2}, 4, 2),
    ({"sharding_strategy": "_HYBRID_SHARD_ZERO2"}, 2, 2),
    ({"stage": 3, "mics_shard_size": 8}, 4, 8),  # two whole nodes
    ({"stage": 3, "zero_hpz_partition_size": 2}, 4, 2),
    ({"stage": 3, "zero_hpz_partition_size": "auto"}, 3, 3),
])
def test_replica_groups_are_the_engines_shard_groups(zero, node, size):
    cfg = TrainConfig.from_dict({"fault_tolerance": "replica", "zero_optimization": zero})
    assert group_size(cfg.zero, node) == size


def test_layout_numbers_groups_by_consecutive_ranks():
    assert [layout(r, 8, 2, 4) for r in range(8)] == [(r // 2, 4, r % 2) for r in range(8)]
    assert layout(5, 8, 8, 4) == (0, 1, 5)
    with pytest.raises(ConfigError, match="do not divide the world of 6"):
        layout(0, 6, 4, 2)
    with pytest.raises(ConfigError, match="straddle nodes of 3 ranks"):
        layout(0, 12, 2, 3)


def test_lamb_has_no_torch_optimizer():
    with pytest.raises(ConfigError, match="AdamW or SGD, not 'lamb'"):
        make_optimizer(OptimSpec("lamb"), [])


def test_the_engine_refuses_replica_mode_instead_of_ignoring_it():
    """ReplicaFT runs replica mode; initialize() given it would train without it, silently."""
    import torch  # the engine's test only: the config tests above need no torch

    from commrt.train import initialize
    with pytest.raises(ConfigError, match="ReplicaFT"):
        initialize(torch.nn.Linear(2, 2), {"fault_tolerance": "replica"})


@pytest.mark.parametrize("replica, replicas, shard, shards", [(3, 3, 0, 1), (-1, 3, 0, 1), (0, 2, 2, 2)])
def test_a_replica_outside_the_job_is_refused_before_it_joins(replica, replicas, shard, shards):
    """Never in a plan, it would end every generation it was left out of: no step would commit."""
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match=f"replica {replica} of {replicas}, shard rank {shard} of {shards}"):
        ReplicaFT(model, torch.optim.SGD(model.parameters(), lr=0.1), replica, replicas, "127.0.0.1:1",
                  shard=shard, shards=shards)


def test_the_replicas_store_is_not_served_off_the_host_unencrypted():
    """As every commrt store (bootstrap, parameter server, elastic rendezvous): the job secret
    would cross the network in the clear, and whoever read it could register as a replica."""
    with pytest.raises(ConfigError, match="refusing to listen on .*192.0.2.1"):
        serve(load_config(environ={}), "192.0.2.1", 1)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="refusing to listen on .*192.0.2.1"):
        ReplicaFT(model, torch.optim.SGD(model.parameters(), lr=0.1), 0, 2, "192.0.2.1:1", load_config(environ={}),
                  serve_store=True)


def test_a_store_that_cannot_be_served_closes_its_transport(monkeypatch):
    """StoreServer raising (its port in use) left the Transport made just before it open: its zmq
    context and, in secret mode, its ZAP thread lived on in a process that went on or retried."""
    from commrt.train import replica_ft
    made = []

    class Recorded(replica_ft.Transport):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            made.append(self)
    monkeypatch.setattr(replica_ft, "Transport", Recorded)
    real = replica_ft.StoreServer  # a port in use is retried for 10 s (a store closed a moment ago)
    monkeypatch.setattr(replica_ft, "StoreServer", lambda t, host, port: real(t, host, port, bind_within_s=0.0))
    monkeypatch.setenv("COMMRT_JOB_SECRET", "x" * 32)
    cfg = load_config(environ={})
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        where = busy.getsockname()
        with pytest.raises(Exception, match="127.0.0.1"):
            serve(cfg, *where)
        model = torch.nn.Linear(2, 2)
        with pytest.raises(Exception, match="127.0.0.1"):
            ReplicaFT(model, torch.optim.SGD(model.parameters(), lr=0.1), 0, 2, f"127.0.0.1:{where[1]}", cfg,
                      serve_store=True)
    assert len(made) == 2 and all(t.closed for t in made)


def test_the_state_transfer_carries_every_group_setting_a_scheduler_changes():
    """OneCycleLR changes Adam's betas as well as the learning rate: a replica that joins must
    take both (the description carried only the learning rate, so the joiner stepped with its
    config's betas while the others used the scheduler's)."""
    def build():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        return model, torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.9, 0.99), weight_decay=0.01)

    src_model, src = build()
    sched = torch.optim.lr_scheduler.OneCycleLR(src, max_lr=0.5, total_steps=10)
    for _ in range(3):
        src_model(torch.ones(2, 4)).sum().backward()
        src.step()
        sched.step()
    desc = replica_state.unpack(replica_state.pack(replica_state.describe(src, src_model)))
    _, joiner = build()
    got, state = replica_state.tensors(src_model, joiner, desc)
    mine, _ = replica_state.tensors(src_model, src, desc)
    for g, t in zip(got[2:], mine[2:]):  # the broadcast, done by hand
        g.copy_(t)
    replica_state.load(joiner, desc, state)
    want = {k: v for k, v in src.param_groups[0].items() if k != "params"}
    have = {k: v for k, v in joiner.param_groups[0].items() if k != "params"}
    assert have == want and isinstance(have["betas"], tuple), (have, want)
    assert want["betas"][0] != 0.9  # the scheduler did change them: the test can tell


def test_a_joiner_whose_model_or_optimizer_differs_is_refused_before_the_transfer():
    """The description carries the layout of what is broadcast: a replica restarted with another
    model or optimizer is told so, instead of failing the transfer in every generation."""
    src_model = torch.nn.Linear(4, 3)
    src = torch.optim.AdamW(src_model.parameters(), lr=0.1)
    desc = replica_state.unpack(replica_state.pack(replica_state.describe(src, src_model)))
    replica_state.check(src_model, torch.optim.AdamW(src_model.parameters(), lr=0.5), desc)  # settings travel
    wide = torch.nn.Linear(4, 5)
    with pytest.raises(ConfigError, match=r"weight \[3, 4\] float32, this replica's weight \[5, 4\]"):
        replica_state.check(wide, torch.optim.AdamW(wide.parameters(), lr=0.1), desc)
    with pytest.raises(ConfigError, match="optimizer: the source's AdamW, this replica's SGD"):
        replica_state.check(src_model, torch.optim.SGD(src_model.parameters(), lr=0.1), desc)


def test_the_state_of_a_model_of_many_tensors_is_handed_over():
    """The state's description went through the store, whose values hold at most 1 MiB: with
    some 15,000 parameter tensors and Adam's state it was refused (ProtocolError), the
    generation failed while forming, and so did every later one with a replica to receive it.
    Here one replica whose optimizer already holds state (resumed) forms its first generation."""
    model = torch.nn.ParameterList(torch.zeros(1) for _ in range(16_500))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for p in model:
        p.grad = torch.ones(1)
    opt.step()
    ft = ReplicaFT(model, opt, 0, 1, f"127.0.0.1:{free_port()}", load_config(environ={}), vote_timeout_s=1.0,
                   serve_store=True, overlap=False)
    try:
        assert ft.start() == 0
        assert ft.plan.gen == 0, "the first generation failed while forming"
    finally:
        ft.close()


def test_a_model_with_a_bool_buffer_forms_its_first_generation():
    """A causal mask kept as a bool buffer (as many transformers do): the state transfer
    broadcast every buffer as it was, and the transport carries no bool, so every replica's
    start() ended in "TypeError: dtype torch.bool is not supported" (the first generation
    sends the source's state to all)."""
    model = torch.nn.Linear(4, 4)
    model.register_buffer("mask", torch.ones(4, 4).tril().bool())
    model.register_buffer("scale", torch.tensor(3, dtype=torch.int16))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ft = ReplicaFT(model, opt, 0, 1, f"127.0.0.1:{free_port()}", load_config(environ={}), vote_timeout_s=1.0,
                   serve_store=True)
    try:
        assert ft.start() == 0 and ft.plan.gen == 0
        model(torch.ones(2, 4)).sum().backward()
        assert ft.step() == 1
    finally:
        ft.close()
    assert torch.equal(model.mask, torch.ones(4, 4).tril().bool()) and int(model.scale) == 3


def test_unfreezing_a_parameter_after_the_replicas_started_is_refused():
    """The gradients averaged are those of the parameters that required grad when ReplicaFT
    was made. One unfrozen later (gradual unfreezing in a fine-tune) got its gradient from
    backward and was stepped by the optimizer with this replica's own gradient, never
    averaged: the replicas' parameters drifted apart without an error (the engine refuses it)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[1].requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ft = ReplicaFT(model, opt, 0, 1, f"127.0.0.1:{free_port()}", load_config(environ={}), vote_timeout_s=1.0,
                   serve_store=True)
    try:
        ft.start()
        model(torch.ones(2, 4)).sum().backward()
        assert ft.step() == 1
        model[1].requires_grad_(True)
        model(torch.ones(2, 4)).sum().backward()
        with pytest.raises(ConfigError, match="requires_grad"):
            ft.step()
    finally:
        ft.close()


def test_calls_out_of_order_are_refused_with_a_config_error():
    """step() before start() failed with an AttributeError on the missing plan; step() after
    close(), and close() twice, with a ZMQError from the closed store socket."""
    model = torch.nn.Linear(4, 2)
    ft = ReplicaFT(model, torch.optim.SGD(model.parameters(), lr=0.1), 0, 1, f"127.0.0.1:{free_port()}",
                   serve_store=True, vote_timeout_s=1.0)
    try:
        model(torch.ones(3, 4)).sum().backward()
        with pytest.raises(ConfigError, match=r"replica 0: ReplicaFT.step\(\) before start\(\)"):
            ft.step()
        assert ft.start() == 0
        with pytest.raises(ConfigError, match=r"ReplicaFT.start\(\) twice"):
            ft.start()
        assert ft.step() == 1 and [s for s, _ in ft.history] == [0]
    finally:
        ft.close()
    ft.close()  # nothing more
    model(torch.ones(3, 4)).sum().backward()
    with pytest.raises(ConfigError, match=r"replica 0: ReplicaFT.step\(\) after close\(\)"):
        ft.step()
