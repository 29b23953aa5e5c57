"""Pipeline parallelism with real ranks against single-process training (issue 16).

``pipeline_job [MODE[,MODE...]] [micro-batch counts...]``, MODE p2p|train|layouts|memory|pipedream|
die|twod (several in one launch: one torch import per rank); every check prints 'OK <case>' or raises. The reference is plain torch on the whole batch in one process.
"""
from __future__ import annotations

import os
import sys
import weakref

import torch
from torch import nn

import commrt
import commrt.train
from commrt.runtime.errors import ConfigError, PeerLost
from commrt.pipeline import (GPipe, Interleaved1F1B, OneFOneB, PipeDream, PipelineStage, isend_tensors,
    recv_tensors, split)
from commrt.pipeline.channels import Channels
from commrt.train import DataParallel
from tests.multirank.programs.common import assert_equal, init

STEPS, ROWS, LR = 3, 12, 0.1
SCHEDULES = {"gpipe": GPipe, "1f1b": OneFOneB, "interleaved": Interleaved1F1B}


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    layers = [nn.Linear(6, 16), nn.Tanh()]
    for _ in range(3):
        layers += [nn.Linear(16, 16), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(16, 4))


def batch(step: int, rows: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s batch: ROWS rows, or ``rows[step]`` (batches whose micro-batches change
    shape from step to step)."""
    n = rows[step] if rows else ROWS
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, 6, generator=g), torch.randn(n, 4, generator=g)


def reference(steps: int, rows: tuple[int, ...] = ()) -> nn.Sequential:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for s in range(steps):
        x, y = batch(s, rows)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model


def stages_of(kind: str, rank: int, world: int):
    per_rank = 2 if kind == "interleaved" else 1
    n = world * per_rank
    parts = split(make_model(), n, by="params" if kind == "1f1b" else "layers")
    return [PipelineStage(parts[s], s, n) for s in range(rank, n, world)], n


def train(kind: str, m: int, rank: int, world: int, rows: tuple[int, ...] = ()) -> None:
    """``rows``: one batch size per step (the default: STEPS steps of ROWS)."""
    stages, n = stages_of(kind, rank, world)
    sched = SCHEDULES[kind](stages if kind == "interleaved" else stages[0], m, nn.functional.mse_loss)
    params = [p for s in stages for p in s.module.parameters()]
    # at 4 ranks interleaved cuts 9 layers into 8 stages: a rank may hold only activations
    opt = torch.optim.SGD(params, lr=LR, momentum=0.9) if params else None
    steps = len(rows) or STEPS
    for s in range(steps):
        x, y = batch(s, rows)
        if opt is not None:
            opt.zero_grad()
        losses = []
        args = (x,) if 0 in sched.stages else ()
        sched.step(*args, target=y if n - 1 in sched.stages else None, losses=losses)
        assert (len(losses) == m) == (n - 1 in sched.stages), losses
        if opt is not None:
            opt.step()
    ref = dict(reference(steps, rows).named_parameters())
    for st in stages:  # a slice of an nn.Sequential keeps the layer indices as names
        for name, p in st.module.named_parameters():
            assert_equal(p.detach(), ref[name].detach(), f"{kind} m={m} stage {st.stage_index} {name}")
    print(f"OK train {kind} m={m}{' rows=' + ','.join(map(str, rows)) if rows else ''}", flush=True)


def twod_case(kind: str, wrap: str, m: int, mesh) -> None:
    """Pipeline x data parallel: stages over the mesh's "pp" groups, each stage's replicas (one per
    "dp" row, each on its share of the global batch) reducing over "dp" with DataParallel or ZeRO
    stage 1. With ``wrap="none"`` nothing reduces: parameters must then differ from the reference
    (what this test would miss if the reduction were dropped)."""
    pp, dp = mesh.size("pp"), mesh.size("dp")
    r, d = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    per_rank = 2 if kind == "interleaved" else 1
    n = pp * per_rank
    parts = split(make_model(), n, by="layers")
    cfg = {"zero_optimization": {"stage": 1}, "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}}}
    wrapped = {"ddp": lambda part: DataParallel(part, group=mesh.get_group("dp")),
               "zero1": lambda part: commrt.train.initialize(part, cfg, group=mesh.get_group("dp")),
               "none": lambda part: part}[wrap]
    stages = [PipelineStage(wrapped(parts[s]), s, n, group=mesh.get_group("pp")) for s in range(r, n, pp)]
    sched = SCHEDULES[kind](stages if kind == "interleaved" else stages[0], m, nn.functional.mse_loss)
    if wrap != "none":  # PipeDream's stashed weights would bypass the wrapper's hooks: refused
        try:
            PipeDream(stages[0], m, nn.functional.mse_loss)
            raise AssertionError("PipeDream took a replicated stage")
        except ConfigError:
            pass
    engines = [st.module for st in stages if wrap == "zero1"]
    opt = None if engines else torch.optim.SGD([p for s in stages for p in s.module.parameters()], lr=LR, momentum=0.9)
    for s in range(STEPS):
        x, y = (t.chunk(dp)[d] for t in batch(s))  # this replica's share of the global batch
        if opt is not None:
            opt.zero_grad()
        sched.step(*((x,) if 0 in sched.stages else ()), target=y if n - 1 in sched.stages else None)
        for e in engines:
            assert e.step(), "the engine skipped its step"
        if opt is not None:
            opt.step()
    ref = dict(reference(STEPS).named_parameters())
    what = f"{kind} {wrap} m={m} stage(s) {sorted(sched.stages)} replica {d}"
    same = True
    for st, part in zip(stages, (parts[s] for s in range(r, n, pp))):
        for name, p in part.named_parameters():
            if wrap != "none":
                assert_equal(p.detach(), ref[name].detach(), f"{what} {name}")
            same = same and torch.allclose(p.detach(), ref[name].detach(), rtol=1e-6, atol=1e-6)
    assert wrap != "none" or not same, f"{what}: equal to the reference without any reduction: the test cannot tell"
    print(f"OK twod {kind} {wrap} m={m}", flush=True)


def twod(micro: list[int]) -> None:
    mesh = commrt.init_device_mesh((2, commrt.get_world_size() // 2), ("dp", "pp"))
    for kind in ("gpipe", "1f1b"):
        for wrap in ("ddp", "zero1", "none"):
            for m in micro:
                twod_case(kind, wrap, m, mesh)
    twod_case("interleaved", "ddp", micro[-1], mesh)


def p2p(rank: int, world: int) -> None:
    """A ring: each rank sends tensor lists of shapes and dtypes its receiver does not know, and a
    batch of known-shape transfers, sends and receives posted together."""
    nxt, prv = (rank + 1) % world, (rank - 1) % world

    def payload(r: int, i: int):
        g = torch.Generator().manual_seed(r * 100 + i)
        return [torch.randn(r + 1, i + 2, generator=g), torch.arange(r * 7 + i, dtype=torch.int64),
                torch.zeros(0, 3), torch.randn(3, generator=g).to(torch.bfloat16), torch.tensor(float(r))]

    handles = [isend_tensors(payload(rank, i), nxt, tag=5, meta=(rank, i)) for i in range(3)]
    for i in range(3):
        meta, got = recv_tensors(prv, tag=5)
        want = payload(prv, i)
        assert meta == (prv, i) and [t.shape for t in got] == [t.shape for t in want], (meta, got)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and torch.equal(a, b), (a, b)
    for h in handles:
        h.wait()
    # the same through the pipeline's channels, receives posted ahead: two channels, two steps (the
    # first sends header + payloads, posted by pump() once the header is in; the second one message
    # at the remembered layout), in the channel's order (a wrong order would mismatch the payloads)
    chans = Channels(None)
    for _ in range(2):
        chans.begin([(prv, 6), (prv, 7)] * 3)
        handles = [chans.send(payload(rank, i), nxt, tag, (tag, i)) for i in range(3) for tag in (7, 6)]
        for i in range(3):
            chans.pump()
            for tag in (6, 7):
                meta, got = chans.take(prv, tag)
                assert meta == (tag, i) and all(torch.equal(a, b) for a, b in zip(got, payload(prv, i))), (meta, got)
        for h in handles:
            h.wait()
    out = torch.full((1 << 18,), float(rank))  # 1 MiB: the zero-copy path
    into = torch.empty_like(out)
    ops = [commrt.P2POp(commrt.irecv, into, prv), commrt.P2POp(commrt.isend, out, nxt)]
    for w in commrt.batch_isend_irecv(ops):
        w.wait()
    assert torch.all(into == float(prv)), into[:4]
    print("OK p2p", flush=True)


class LiveSaved:
    """Counts tensors autograd saved for backward that are still alive: the real activation
    memory, measured independently of the schedule's own bookkeeping."""

    def __init__(self):
        self.live = self.peak = 0

    class Box:
        __slots__ = ("t", "__weakref__")

        def __init__(self, t):
            self.t = t

    def pack(self, t):
        box = self.Box(t)
        self.live += 1
        self.peak = max(self.peak, self.live)
        weakref.finalize(box, self._dead)
        return box

    def _dead(self):
        self.live -= 1

    @staticmethod
    def unpack(box):
        return box.t


def memory(rank: int, world: int) -> None:
    m = 8
    peaks = {}
    for kind in ("gpipe", "1f1b"):
        (stage,), n = stages_of(kind, rank, world)
        sched = SCHEDULES[kind](stage, m, nn.functional.mse_loss)
        counter = LiveSaved()
        x, y = batch(0)
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
            sched.step(*((x,) if rank == 0 else ()), target=y if rank == n - 1 else None)
        one = LiveSaved()  # what one micro-batch keeps for backward on this stage
        with torch.autograd.graph.saved_tensors_hooks(one.pack, one.unpack):
            width = next(l.in_features for l in stage.module if isinstance(l, nn.Linear))
            out = stage.module(torch.randn(2, width, requires_grad=not stage.is_first))
            if stage.is_last:
                out = nn.functional.mse_loss(out, torch.zeros_like(out))
        per_mb = one.peak
        del out
        assert counter.peak % per_mb == 0, (counter.peak, per_mb)
        peaks[kind] = counter.peak // per_mb
        assert counter.live == 0, f"{kind}: {counter.live} saved tensors outlived the step"
    assert peaks["gpipe"] == m, peaks
    assert peaks["1f1b"] == min(world - rank, m) <= world, peaks
    print(f"OK memory gpipe={peaks['gpipe']} 1f1b={peaks['1f1b']}", flush=True)


def pipedream_reference(num_batches: int, m: int, staleness: int) -> nn.Sequential:
    """2BW's rule in one process: W(b+1) = W(b) - lr * grad_b(W(b - staleness))."""
    model = make_model()
    versions = [[p.detach().clone() for p in model.parameters()]]
    for b in range(num_batches):
        old = versions[max(0, b - staleness)]
        with torch.no_grad():
            for p, w in zip(model.parameters(), old):
                p.copy_(w)
        model.zero_grad()
        x, y = batch(b)
        nn.functional.mse_loss(model(x), y).backward()
        versions.append([w - LR * p.grad for w, p in zip(versions[-1], model.parameters())])
    with torch.no_grad():
        for p, w in zip(model.parameters(), versions[-1]):
            p.copy_(w)
    return model


def pipedream(rank: int, world: int, m: int) -> None:
    nb = 4
    xs, ys = zip(*(batch(b) for b in range(nb)))
    x, y = torch.cat(xs), torch.cat(ys)
    for stash in (True, False):
        (stage,), n = stages_of("gpipe", rank, world)
        sched = PipeDream(stage, m, nn.functional.mse_loss, lr=LR, num_batches=nb, stash_weights=stash)
        sched.step(*((x,) if rank == 0 else ()), target=y if rank == n - 1 else None)
        ref = dict(pipedream_reference(nb, m, sched.staleness).named_parameters())
        same = all(torch.allclose(p, ref[k], rtol=0, atol=1e-6) for k, p in stage.module.named_parameters())
        if stash:
            assert same, f"PipeDream with weight stashing differs from the 2BW reference on stage {rank}"
            assert sched.versions_kept <= sched.staleness + 2, sched.versions_kept
        elif rank == 0 and world > 1:
            # stage 0 runs ahead the most: without stashing its backwards see newer weights
            assert not same, "PipeDream without stashing matched the reference: the test cannot tell"
    print(f"OK pipedream m={m}", flush=True)


def die(rank: int, world: int) -> None:
    """The last stage exits mid-step; every other stage must name it in PeerLost."""
    (stage,), n = stages_of("1f1b", rank, world)
    sched = OneFOneB(stage, 4, nn.functional.mse_loss)
    if rank == world - 1:
        # die mid-step: once the first activation has arrived (dying right after init could lose
        # this rank's own init-barrier messages on connections still in their handshake, which
        # would fail the others' init instead of their step)
        recv_tensors(rank - 1, None, 2 * (world - 1))
        os._exit(3)
    x, y = batch(0)
    try:
        sched.step(*((x,) if rank == 0 else ()))
    except PeerLost as exc:
        assert exc.rank == world - 1, exc
        print(f"OK peer lost {exc.rank}", flush=True)
        commrt.destroy_process_group()  # a clean exit delivers the relayed notice to the next rank
        os._exit(0)
    raise AssertionError("the step finished although the last stage died")


def run_mode(mode: str, rest: list[int], rank: int, world: int) -> None:
    if mode == "p2p":
        p2p(rank, world)
    elif mode == "train":
        for kind in SCHEDULES:
            for m in rest or [1, 3, 4, 8]:
                train(kind, m, rank, world)
    elif mode == "layouts":  # micro-batch shapes that change between steps, and back (channels.py)
        for kind in SCHEDULES:
            train(kind, 4, rank, world, rows=(12, 12, 9, 9, 12))
    elif mode == "memory":
        memory(rank, world)
    elif mode == "pipedream":
        for m in rest or [1, 2, 4]:
            pipedream(rank, world, m)
    elif mode == "die":
        die(rank, world)
    elif mode == "twod":
        twod(rest or [3, 4])
    else:
        raise SystemExit(f"pipeline_job: unknown mode {mode!r}")


def main() -> int:
    rank, world = init()
    modes, rest = (sys.argv[1] if len(sys.argv) > 1 else "train"), [int(v) for v in sys.argv[2:]]
    for mode in modes.split(","):  # several modes in one launch ("p2p,memory"): one torch import per rank
        run_mode(mode, rest, rank, world)
    commrt.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
