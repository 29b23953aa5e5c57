"""Edge cases of DataParallel and the ZeRO engine found by the training review, each against
single-process torch on the global batch (zero_job's data and comparison). One case per run:
``python -m tests.multirank.programs.train_edges <case>``; each prints 'OK <what>' or raises.
"""
from __future__ import annotations

import gc
import sys
import time

import torch
from torch import nn

import commrt
from commrt.train import DataParallel, initialize
from tests.multirank.programs.zero_job import compare, data, make_model

SGD = {"type": "SGD", "params": {"lr": 0.1}}


class TwoHeads(nn.Module):
    """A shared body and two heads, one per task: each micro-step uses one head only."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.h1, self.h2 = nn.Linear(7, 6), nn.Linear(6, 5), nn.Linear(6, 5)

    def forward(self, x, head):
        return (self.h1 if head == 1 else self.h2)(torch.tanh(self.body(x)))


def ddp_no_sync_case(rank: int, world: int) -> None:
    """A head used only in the no_sync micro-step (on every rank) looked unused at the
    synchronised backward (its flag was reset by that forward), so its accumulated gradient was
    never averaged: each rank kept its own and the replicas drifted (h1 off by 0.4 at 2 ranks)."""
    ref = TwoHeads()
    for r in range(world):
        for micro, head in ((0, 1), (1, 2)):
            x, y = data(r, 0, micro)
            (nn.functional.mse_loss(ref(x, head), y) / world).backward()
    model = DataParallel(TwoHeads(), bucket_cap_mb=40 * 4 / (1 << 20))  # about one linear a bucket
    x, y = data(rank, 0, 0)
    with model.no_sync():
        nn.functional.mse_loss(model(x, 1), y).backward()
    x, y = data(rank, 0, 1)
    nn.functional.mse_loss(model(x, 2), y).backward()
    compare({n: p.grad for n, p in model.module.named_parameters()},
            {n: p.grad for n, p in ref.named_parameters()}, "DataParallel parameter used only under no_sync",
            atol=1e-6)


def _two_backwards_reference(world: int, steps: int) -> dict:
    """torch: two backwards (micro-batches 0 and 1 of the global batch) add up before each step."""
    model = make_model()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=SGD["params"]["lr"])
    for step in range(steps):
        opt.zero_grad()
        for micro in range(2):
            xs, ys = zip(*(data(r, step, micro) for r in range(world)))
            nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def two_backwards_case(rank: int, world: int) -> None:
    """Two engine.backward() calls before one step() (gradient_accumulation_steps 1): stages 0-1
    dropped the first backward's gradient, stages 2-3 added both, as torch does (0.044 apart)."""
    want = _two_backwards_reference(world, steps=2)
    for stage, bf16 in ((0, False), (1, False), (2, False), (3, False), (0, True), (1, True)):
        engine = initialize(make_model(), {"zero_optimization": {"stage": stage, "reduce_bucket_size": 40},
                                           "optimizer": SGD, "bf16": {"enabled": bf16}})
        for step in range(2):
            for micro in range(2):
                x, y = data(rank, step, micro)
                engine.backward(nn.functional.mse_loss(engine(x), y))
            engine.step()
        compare(engine.full_state_dict(), want, f"stage {stage}{' bf16' if bf16 else ''} two backwards, one step",
                atol=1e-2 if bf16 else 1e-6)


class Boom(torch.autograd.Function):
    """The identity, whose backward raises while ``armed``."""
    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if Boom.armed:
            raise RuntimeError("an error in backward")
        return g


class Fragile(TwoHeads):
    def forward(self, x):
        return self.h1(Boom.apply(torch.tanh(self.body(x))))


def ddp_backward_raised_case(rank: int, world: int) -> None:
    """A backward that raised on every rank after its first bucket was reduced (an error in an
    autograd node between the layers, caught by the loop) left DataParallel waiting for an
    end of backward that never came: from then on no gradient was averaged, each replica
    stepped on its own (0.025 from torch after two steps, and apart from each other)."""
    model = DataParallel(Fragile(), bucket_cap_mb=40 * 4 / (1 << 20))  # about one linear a bucket
    opt = torch.optim.SGD(model.parameters(), lr=SGD["params"]["lr"])
    Boom.armed = True
    x, y = data(rank, 0)
    try:
        nn.functional.mse_loss(model(x), y).backward()
        raise AssertionError("the backward did not raise")
    except RuntimeError as exc:
        assert "an error in backward" in str(exc), exc
    finally:
        Boom.armed = False
    ref = Fragile()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=SGD["params"]["lr"])
    for step in range(1, 3):
        opt.zero_grad()
        x, y = data(rank, step)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        ref_opt.zero_grad()
        xs, ys = zip(*(data(r, step) for r in range(world)))
        nn.functional.mse_loss(ref(torch.cat(xs)), torch.cat(ys)).backward()
        ref_opt.step()
    compare({n: p.detach() for n, p in model.module.named_parameters()},
            {n: p.detach() for n, p in ref.named_parameters()}, "DataParallel after a backward that raised",
            atol=1e-6)


class Late(torch.autograd.Function):
    """The identity, whose backward (the first node a backward runs) waits a second on rank 1
    while ``Boom.armed``: rank 0's first all-reduce then ends after rank 0 has raised and moved on."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if Boom.armed and commrt.get_rank() == 1:
            time.sleep(1.0)
        return g


class OneHead(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.h1 = nn.Linear(7, 6), nn.Linear(6, 5)

    def forward(self, x):
        return Late.apply(self.h1(Boom.apply(torch.tanh(self.body(x)))))


def ddp_raised_zeroed_in_place_case(rank: int, world: int) -> None:
    """A backward that raised with an all-reduce in flight on the bucket buffer its gradients
    view (gradient_as_bucket_view), and the caller's optimizer.zero_grad(set_to_none=False):
    the all-reduce ended after it (its peer was late) and wrote the failed backward's averaged
    gradients back into the zeroed p.grad, which the next backward added to (0.0002 from torch
    after two steps, silently)."""
    model = DataParallel(OneHead(), bucket_cap_mb=40 * 4 / (1 << 20))  # about one linear a bucket
    opt = torch.optim.SGD(model.parameters(), lr=SGD["params"]["lr"])
    ref = OneHead()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=SGD["params"]["lr"])
    for step in range(4):
        opt.zero_grad(set_to_none=False)  # p.grad stays the bucket's view from the first step on
        x, y = data(rank, step)
        Boom.armed = step == 1
        try:
            nn.functional.mse_loss(model(x), y).backward()
        except RuntimeError as exc:
            assert Boom.armed and "an error in backward" in str(exc), exc
            continue
        finally:
            Boom.armed = False
        opt.step()
        ref_opt.zero_grad()
        xs, ys = zip(*(data(r, step) for r in range(world)))
        nn.functional.mse_loss(ref(torch.cat(xs)), torch.cat(ys)).backward()
        ref_opt.step()
    compare({n: p.detach() for n, p in model.module.named_parameters()},
            {n: p.detach() for n, p in ref.named_parameters()},
            "DataParallel after a backward that raised, gradients zeroed in place", atol=1e-6)


def ddp_dropped_case(rank: int, world: int) -> None:
    """A DataParallel let go of kept its gradient hooks on the module's parameters (and itself
    alive through them): a later backward of the bare module, here on each rank's own data, was
    still all-reduced (one rank's alone waited out the deadline), where torch DDP's go with it."""
    model = TwoHeads()
    wrapped = DataParallel(model, bucket_cap_mb=40 * 4 / (1 << 20))
    x, y = data(rank, 0)
    nn.functional.mse_loss(wrapped(x, 1), y).backward()
    del wrapped
    gc.collect()
    local = TwoHeads()
    local.load_state_dict(model.state_dict())
    for net in (model, local):
        net.zero_grad()
        x, y = data(rank, 1)
        nn.functional.mse_loss(net(x, 1), y).backward()
    compare({n: p.grad for n, p in model.named_parameters() if p.grad is not None},
            {n: p.grad for n, p in local.named_parameters() if p.grad is not None},
            "DataParallel let go of: the bare module's gradients are its own", atol=0)


def _local_sgd(model: nn.Module, rank: int) -> None:
    """Two plain torch SGD steps on this rank's own data (no collective)."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=SGD["params"]["lr"])
    for step in range(1, 3):
        opt.zero_grad()
        x, y = data(rank, step)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def closed_case(rank: int, world: int) -> None:
    """close() left the engine's hooks on the model: a plain torch loop on it afterwards went
    through the closed engine. Stage 3 released every parameter after its forward and gathered
    the pre-close master again for backward, so each local SGD update was lost (and each forward
    was a collective: one rank alone waited out the deadline); the parameters were empty."""
    for stage in (0, 1, 2, 3):
        engine = initialize(make_model(), {"zero_optimization": {"stage": stage, "reduce_bucket_size": 40},
                                           "optimizer": SGD})
        x, y = data(rank, 0)
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
        values = engine.full_state_dict()
        engine.close()
        engine.close()  # twice: nothing more
        ref = make_model()
        ref.load_state_dict(values)
        compare({n: p.detach() for n, p in engine.module.named_parameters()}, values,
                f"stage {stage} closed: parameters", atol=0)
        _local_sgd(engine.module, rank)
        _local_sgd(ref, rank)
        compare({n: p.detach() for n, p in engine.module.named_parameters()},
                {n: p.detach() for n, p in ref.named_parameters()}, f"stage {stage} closed: plain torch after",
                atol=1e-6)


CASES = {"ddp_no_sync": ddp_no_sync_case, "two_backwards": two_backwards_case, "closed": closed_case,
         "ddp_backward_raised": ddp_backward_raised_case, "ddp_dropped": ddp_dropped_case,
         "ddp_raised_zeroed_in_place": ddp_raised_zeroed_in_place_case}


def main() -> int:
    torch.set_num_threads(1)
    commrt.init_process_group()
    for case in sys.argv[1].split(","):  # several cases in one launch: one torch import per rank
        CASES[case](commrt.get_rank(), commrt.get_world_size())
    commrt.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
