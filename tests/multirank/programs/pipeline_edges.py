"""Pipeline edges with real ranks: layouts that change between steps and between micro-batches,
and a stage that modifies its input in place, against a single-process reference; a stage that
raises mid-step; ranks whose schedules disagree; a dead stage of a pipeline subgroup.

Also stage outputs that cannot be sent (a bool mask, too many tensors).

``pipeline_edges <case> [<case> ...]`` (see main); every check prints 'OK <case>' or raises.
"""
from __future__ import annotations

import os
import sys
import time

import torch
from torch import nn

import commrt
from commrt.pipeline import GPipe, OneFOneB, PipelineStage, StageFailed, recv_tensors
from commrt.runtime.errors import CommError, ConfigError, PeerLost
from tests.multirank.programs.common import assert_equal, init

LR = 0.1
# one step each: (rows, ids dtype, extra, big). extra: "grad" (a function of a parameter),
# "nograd" (of the input only), "some" (only on micro-batches of 4 rows), None (absent).
# big: a 4 MiB tensor the next stage ignores (over COMBINE_MAX: the header path both ways)
STEPS = [(12, torch.int64, "grad", False), (12, torch.int64, "grad", False),
         (10, torch.int32, "nograd", False), (10, torch.int32, "some", False),
         (12, torch.int64, "grad", True), (12, torch.int64, "grad", True),
         (12, torch.int64, "grad", False), (12, torch.int64, None, False), (12, torch.int64, "grad", False)]


class Head(nn.Module):
    """Stage 0: several outputs whose number, dtypes, shapes and requires_grad follow ``variant``."""

    def __init__(self):
        super().__init__()
        self.lin, self.scale = nn.Linear(6, 8), nn.Parameter(torch.tensor(0.5))
        self.variant = STEPS[0]

    def forward(self, x):
        _, ids_dtype, extra, big = self.variant
        outs = [torch.tanh(self.lin(x)), (x[:, 0] > 0).to(ids_dtype)]
        if extra == "grad" or extra == "some" and x.shape[0] == 4:
            outs.append(x[:, 1:2] * self.scale)
        elif extra == "nograd":
            outs.append(x[:, 1:2] * 2)
        if big:
            outs.append(torch.zeros(1 << 20))
        return tuple(outs)


class Tail(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.w, self.v = nn.Linear(8, 4), nn.Parameter(torch.ones(4)), nn.Parameter(torch.full((4,), 0.3))

    def forward(self, h, ids, *rest):
        out = self.lin(h) + ids.unsqueeze(1).to(h.dtype) * self.w
        for r in rest:
            if r.dim() == 2:  # the extra column; the big tensor is ignored
                out = out + r * self.v
        return out


def models():
    torch.manual_seed(0)
    return Head(), Tail()


def data(step: int):
    g = torch.Generator().manual_seed(500 + step)
    rows = STEPS[step][0]
    return torch.randn(rows, 6, generator=g), torch.randn(rows, 4, generator=g)


def reference(m: int):
    """Per step: the outputs, each micro-batch's loss and the parameters after SGD, in one process
    (the micro-batches cut as the schedule cuts them, since the outputs depend on the cut)."""
    head, tail = models()
    params = [*head.parameters(), *tail.parameters()]
    opt = torch.optim.SGD(params, lr=LR)
    out = []
    for s, variant in enumerate(STEPS):
        head.variant = variant
        x, y = data(s)
        opt.zero_grad()
        outs, losses = [], []
        for xm, ym in zip(torch.tensor_split(x, m), torch.tensor_split(y, m)):
            o = tail(*head(xm))
            loss = nn.functional.mse_loss(o, ym)
            (loss * ym.shape[0] / y.shape[0]).backward()
            outs.append(o.detach())
            losses.append(loss.detach())
        opt.step()
        out.append((torch.cat(outs), losses, [p.detach().clone() for p in params]))
    return out


def layouts(rank: int, kind: str, m: int) -> None:
    head, tail = models()
    module = (head, tail)[rank]
    sched = {"gpipe": GPipe, "1f1b": OneFOneB}[kind](PipelineStage(module, rank, 2), m, nn.functional.mse_loss)
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    ref = reference(m)
    kept = []
    for s, variant in enumerate(STEPS):
        head.variant = variant
        x, y = data(s)
        opt.zero_grad()
        losses = []
        out = sched.step(*((x,) if rank == 0 else ()), target=y if rank == 1 else None, losses=losses)
        opt.step()
        want_out, want_losses, want_params = ref[s]
        what = f"{kind} m={m} step {s} {variant}"
        if rank == 1:
            assert_equal(out, want_out, f"{what}: outputs")
            assert_equal(torch.stack(losses), torch.stack(want_losses), f"{what}: losses")
            kept.append((out, out.clone()))
        mine = list(module.parameters())
        theirs = want_params[:len(mine)] if rank == 0 else want_params[len(want_params) - len(mine):]
        for i, (p, w) in enumerate(zip(mine, theirs)):
            assert_equal(p.detach(), w, f"{what}: parameter {i}")
    for i, (out, copy) in enumerate(kept):  # nothing returned is a view of a reused buffer
        assert torch.equal(out, copy), f"{kind} m={m}: step {i}'s outputs changed after later steps"
    print(f"OK layouts {kind} m={m}", flush=True)


def inplace_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(inplace=True), nn.Linear(16, 16), nn.ReLU(inplace=True),
                         nn.Linear(16, 4))


def inplace(rank: int, kind: str) -> None:
    """Stage 1 starts with ``nn.ReLU(inplace=True)`` (a cut where a torchvision-style model often
    has one): it modifies the activation it received in place, which a single process allows.
    Parameters after two steps equal a single process's."""
    module = inplace_model()[:1] if rank == 0 else inplace_model()[1:]
    sched = {"gpipe": GPipe, "1f1b": OneFOneB}[kind](PipelineStage(module, rank, 2), 3, nn.functional.mse_loss)
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    ref = inplace_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for s in range(2):
        x, y = data(s)
        opt.zero_grad()
        sched.step(*((x,) if rank == 0 else ()), target=y if rank == 1 else None)
        opt.step()
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    want = dict(ref.named_parameters())
    for name, p in module.named_parameters():
        assert_equal(p.detach(), want[name].detach(), f"inplace {kind} {name}")
    print(f"OK inplace {kind}", flush=True)


class _Boom(torch.autograd.Function):
    """Identity whose backward raises: a stage that fails in its backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        raise ValueError("backward exploded")


class Failing(nn.Module):
    """A stage that raises in its second forward, or the second backward through it."""

    def __init__(self, where: str):
        super().__init__()
        self.lin, self.where, self.calls = nn.Linear(6, 6), where, 0

    def forward(self, x):
        self.calls += 1
        if self.where == "forward" and self.calls == 2:
            raise ValueError("forward exploded")
        x = self.lin(x)
        return _Boom.apply(x) if self.where == "backward" and self.calls == 2 else x


def fails(rank: int, world: int, bad: int, where: str) -> None:
    """Stage ``bad`` raises (``where``: in its second forward, backward or loss, or refusing its
    inputs) and its process stays: every stage still owed a message by it must raise StageFailed
    naming ``bad`` and its error, told by its own neighbour, instead of waiting out the deadline."""
    group = commrt.new_group(list(range(world)))  # a fresh set of channels for each case
    torch.manual_seed(0)
    module = Failing(where if rank == bad else "")
    calls = [0]

    def loss_fn(out, target):
        calls[0] += 1
        if rank == bad and where == "loss" and calls[0] == 2:
            raise ValueError("loss exploded")
        return nn.functional.mse_loss(out, target)
    sched = OneFOneB(PipelineStage(module, rank, world, group=group), 4, loss_fn)
    x, y = torch.randn(3 if where == "input" else 8, 6), torch.randn(8, 6)
    want = {"forward": f"{bad}F1 raised ValueError: forward exploded", "loss": f"{bad}F1 raised ValueError: "
            "loss exploded", "backward": f"{bad}B1 raised ValueError: backward exploded",
            "input": "step() raised ConfigError: inputs: 3 rows cannot make 4 micro-batches"}[where]
    try:
        sched.step(*((x,) if rank == 0 else ()), target=y if rank == world - 1 else None)
        raise AssertionError(f"rank {rank}: the step finished although stage {bad} raised")
    except ValueError as exc:  # ConfigError is one too
        assert rank == bad and want.rpartition(": ")[2] in str(exc), exc
    except StageFailed as exc:
        told_by = rank + 1 if rank < bad else rank - 1  # its neighbour on the way to the failed rank
        assert rank != bad and exc.rank == bad and want in str(exc), exc
        assert exc.reported_by == (None if told_by == bad else told_by), (exc, exc.reported_by)
    try:  # the failed step's receives stay posted and its messages in flight: no step after it
        sched.step(*((x,) if rank == 0 else ()), target=y if rank == world - 1 else None)
        raise AssertionError(f"rank {rank}: a step ran after a failed one")
    except CommError as exc:
        assert "an earlier step failed" in str(exc) and ("exploded" in str(exc) or "rows" in str(exc)), exc
    commrt.barrier()  # the failing rank stays until every other has seen the failure
    print(f"OK fails {bad} {where}", flush=True)


class Unsendable(nn.Module):
    """Stage 0 whose outputs cannot cross the wire: ``what`` "complex" (complex64 is not in the
    wire's dtype list) or "many" (65 tensors: more than one message's header holds)."""

    def __init__(self, what: str):
        super().__init__()
        self.lin, self.what = nn.Linear(6, 6), what

    def forward(self, x):
        h = self.lin(x)
        if self.what == "complex":
            return h, h.to(torch.complex64)
        return tuple(h[:, i % 6] for i in range(65))


def unsendable(rank: int, what: str) -> None:
    """Stage 0's only message of its channel (one micro-batch) cannot be sent: rank 0 raises
    saying why, and rank 1, owed that message, gets StageFailed at once. Before, the message
    counted as sent although nothing went, so no notice followed and rank 1 waited out its
    deadline (60 s here), then blamed rank 0 as lost."""
    group = commrt.new_group([0, 1])
    module = Unsendable(what) if rank == 0 else nn.Linear(6, 6)
    sched = OneFOneB(PipelineStage(module, rank, 2, group=group), 1, lambda out, y: out.float().sum())
    why = {"complex": "torch.complex64", "many": "65 tensors"}[what]
    start = time.monotonic()
    try:
        sched.step(*((torch.randn(4, 6),) if rank == 0 else ()), target=torch.zeros(4, 6) if rank else None)
        raise AssertionError(f"rank {rank}: the step finished although stage 0's output cannot be sent")
    except (TypeError, ValueError) as exc:  # ConfigError is a ValueError
        assert rank == 0 and why in str(exc), exc
    except StageFailed as exc:
        took = time.monotonic() - start
        assert rank == 1 and exc.rank == 0 and why in str(exc), exc
        assert took < 15, f"rank 1 was told after {took:.1f}s"
    commrt.barrier()
    print(f"OK unsendable {what}", flush=True)


class Masking(nn.Module):
    """Stage 0 of ``mask``: an activation and the bool mask of its positive entries."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        h = self.lin(x)
        return h, h > 0


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 4)

    def forward(self, h, keep):
        return self.lin(h.masked_fill(~keep, 0.0))


def mask(rank: int, kind: str) -> None:
    """A bool mask between stages (a wire dtype since wire version 3) trains like one process."""
    torch.manual_seed(0)
    head, tail = Masking(), Masked()
    module = (head, tail)[rank]
    sched = {"gpipe": GPipe, "1f1b": OneFOneB}[kind](PipelineStage(module, rank, 2), 3, nn.functional.mse_loss)
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    torch.manual_seed(0)
    ref = nn.ModuleList([Masking(), Masked()])
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for s in range(2):
        x, y = data(s)
        opt.zero_grad()
        sched.step(*((x,) if rank == 0 else ()), target=y if rank == 1 else None)
        opt.step()
        ref_opt.zero_grad()
        for xm, ym in zip(torch.tensor_split(x, 3), torch.tensor_split(y, 3)):
            (nn.functional.mse_loss(ref[1](*ref[0](xm)), ym) * ym.shape[0] / y.shape[0]).backward()
        ref_opt.step()
    for name, p in module.named_parameters():
        assert_equal(p.detach(), dict(ref[rank].named_parameters())[name].detach(), f"mask {kind} {name}")
    print(f"OK mask {kind}", flush=True)


def mismatch(rank: int) -> None:
    """Two ranks built with different micro-batch counts: a ConfigError naming both counts on
    the rank that receives first, StageFailed carrying it on the other."""
    group = commrt.new_group([0, 1])
    sched = OneFOneB(PipelineStage(nn.Linear(6, 6), rank, 2, group=group), 4 - rank, nn.functional.mse_loss)
    x, y = torch.randn(8, 6), torch.randn(8, 6)
    try:
        sched.step(*((x,) if rank == 0 else ()), target=y if rank == 1 else None)
        raise AssertionError(f"rank {rank}: the step finished although the schedules disagree")
    except (ConfigError, StageFailed) as exc:
        assert type(exc) is (ConfigError if rank == 1 else StageFailed), exc
        assert "4 micro-batches" in str(exc) and "3 micro-batches" in str(exc), exc
    commrt.barrier()
    print("OK mismatch", flush=True)


def die_in_subgroup(rank: int) -> None:
    """A pipeline on ranks [0, 2] of 3 (a subgroup, as a device mesh's "pp" groups are): rank 2
    dies mid-step; rank 0's PeerLost must name global rank 2 (its group rank is 1, another rank)."""
    group = commrt.new_group([0, 2])
    if rank == 1:  # not in the pipeline: alive until rank 0 is done, then gone without a goodbye
        commrt.recv(torch.zeros(1), src=0)
        os._exit(0)
    stage = PipelineStage(nn.Linear(6, 6), rank // 2, 2, group=group)
    sched = OneFOneB(stage, 4, nn.functional.mse_loss)
    if rank == 2:
        recv_tensors(0, group, 2)  # die once the first activation is in (the channels' first message is split)
        os._exit(3)
    try:
        sched.step(torch.randn(8, 6))
    except PeerLost as exc:
        assert exc.rank == 2, exc
        print(f"OK subgroup peer lost {exc.rank}", flush=True)
    finally:
        commrt.send(torch.zeros(1), dst=1)
    os._exit(0)  # no OK printed if the step finished although stage 1 died


def main() -> int:
    """Runs each case named on the command line, in order: ``layouts``, ``inplace``, ``mismatch``,
    ``fails=<rank>:<where>``, ``unsendable=<complex|many>``, ``mask``, ``die_in_subgroup`` (one launch for several: each costs seconds)."""
    rank, world = init()
    for case in sys.argv[1:]:
        mode, _, arg = case.partition("=")
        if mode == "layouts":
            for kind, m in (("gpipe", 4), ("1f1b", 3)):
                layouts(rank, kind, m)
        elif mode == "inplace":
            for kind in ("gpipe", "1f1b"):
                inplace(rank, kind)
        elif mode == "fails":
            bad, where = arg.split(":")
            fails(rank, world, int(bad), where)
        elif mode == "die_in_subgroup":
            die_in_subgroup(rank)
        elif mode == "mismatch":
            mismatch(rank)
        elif mode == "unsendable":
            unsendable(rank, arg)
        elif mode == "mask":
            for kind in ("gpipe", "1f1b"):
                mask(rank, kind)
        else:
            raise ValueError(f"unknown case {case!r}")
    commrt.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
