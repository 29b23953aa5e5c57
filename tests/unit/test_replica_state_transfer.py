"""Replica FT's state transfer goes in a few large broadcasts (per dtype, at most CAP_BYTES
each), not one per tensor: a model of 20,000 parameter tensors with Adam's state cost some
80,000 broadcasts and 14 s. What arrives is bit for bit what the source holds."""
from __future__ import annotations

import math

import torch

from commrt.launch import free_port
from commrt.runtime.config import load_config
from commrt.train import replica_state
from commrt.train.replica_ft import ReplicaFT


def _trained(seed: int, n: int = 40, steps: int = 2):
    torch.manual_seed(seed)
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(3, i % 5 + 1)) for i in range(n)]
                                   + [torch.nn.Parameter(torch.randn(300, dtype=torch.float64))])
    model.register_buffer("mask", torch.rand(7, 3) > 0.5)
    model.register_buffer("scale", torch.tensor(-3, dtype=torch.int16))
    model.register_buffer("big", torch.randn(2000))  # 8,000 bytes: over the test's cap, goes alone
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
    with torch.no_grad():  # values a sloppy transfer (through float arithmetic) would change
        model[0].view(-1)[:3] = torch.tensor([-0.0, math.nan, 1e-45])
    return model, opt


def _send(model, opt, cap: int) -> list[torch.Tensor]:
    desc = replica_state.unpack(replica_state.pack(replica_state.describe(opt, model)))
    ts, _ = replica_state.tensors(model, opt, desc)
    sent = []
    replica_state.transfer(lambda flat: sent.append(flat.clone()), ts, True, cap)
    return sent


def test_a_joiner_receives_every_tensor_bit_for_bit_in_few_broadcasts():
    src_model, src = _trained(0)
    cap = 4096
    sent = _send(src_model, src, cap)
    model, opt = _trained(1, steps=0)  # no optimizer state yet: allocated from the description
    desc = replica_state.unpack(replica_state.pack(replica_state.describe(src, src_model)))
    replica_state.check(model, opt, desc)
    ts, state = replica_state.tensors(model, opt, desc)
    queue = list(sent)

    def receive(flat):
        got = queue.pop(0)
        assert got.dtype == flat.dtype and got.shape == flat.shape
        flat.copy_(got)
    with torch.no_grad():
        replica_state.transfer(receive, ts, False, cap)
    replica_state.load(opt, desc, state)
    assert not queue and type(opt.param_groups[0]["params"]) is list
    wire = [replica_state.on_wire(t) for t in ts]
    assert len(sent) <= 4 + sum(w.numel() * w.element_size() for w in wire) // cap + 4, len(sent)  # 4 dtypes
    assert len(sent) < len(ts) // 4, (len(sent), len(ts))
    for (n, a), (_, b) in zip([*src_model.named_parameters(), *src_model.named_buffers()],
                              [*model.named_parameters(), *model.named_buffers()]):
        assert a.dtype == b.dtype and torch.equal(a.view(-1).view(torch.uint8) if a.dtype != torch.bool else a,
                                                  b.view(-1).view(torch.uint8) if b.dtype != torch.bool else b), n
    for i, entry in src.state_dict()["state"].items():
        for k, v in entry.items():
            w = opt.state_dict()["state"][i][k]
            assert torch.equal(v.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8)), (i, k)


def test_the_broadcasts_are_per_dtype_and_size_not_per_tensor():
    """20,000 small tensors (three dtypes) go in one broadcast per dtype under the default cap."""
    ts = [torch.zeros(2, dtype=(torch.float32, torch.float64, torch.bool)[i % 3]) for i in range(20_000)]
    calls = []
    replica_state.transfer(lambda flat: calls.append((flat.dtype, flat.numel())), ts, True)
    assert sorted(str(d) for d, _ in calls) == ["torch.bool", "torch.float32", "torch.float64"], calls
    assert sum(n for _, n in calls) == 40_000
    small = []
    replica_state.transfer(lambda flat: small.append(flat.numel() * flat.element_size()), ts, True, 4096)
    assert max(small) <= 4096 and len(small) <= 3 + sum(small) // 4096 + 3, len(small)


def test_a_replica_sends_its_state_in_a_few_broadcasts():
    """Through ReplicaFT: the first generation (one replica, its own source) hands over 5,000
    parameter tensors with Adam's state in a handful of broadcasts, not 15,000."""
    model = torch.nn.ParameterList(torch.zeros(1) for _ in range(5_000))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for p in model:
        p.grad = torch.ones(1)
    opt.step()
    ft = ReplicaFT(model, opt, 0, 1, f"127.0.0.1:{free_port()}", load_config(environ={}), vote_timeout_s=1.0,
                   serve_store=True, overlap=False)
    sync, calls = ft._sync, []

    def counted(plan):
        backend = ft.rt.world.backend
        cast = backend.broadcast
        backend.broadcast = lambda t, src, async_op: (calls.append(t.numel()), cast(t, src, async_op))[1]
        try:
            return sync(plan)
        finally:
            backend.broadcast = cast
    ft._sync = counted
    try:
        assert ft.start() == 0 and ft.plan.gen == 0
    finally:
        ft.close()
    assert 0 < len(calls) <= 2 + 2, f"{len(calls)} broadcasts for the state of 5,000 parameters"
