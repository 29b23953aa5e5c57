"""ZeRO and DataParallel against single-process training on the global batch, at this world size.

Every case prints 'OK <case>' or raises; the reference is plain torch (torch.optim.AdamW, or the
whole-tensor LAMB step, which the unit tests check against the paper) run locally on the
concatenation of every rank's batch.
"""
from __future__ import annotations

import copy
import glob
import os
import shutil
import sys
import tempfile

import torch
from torch import nn

import commrt
from commrt.optim import rules as optim
from commrt.runtime.errors import ConfigError
from commrt.train import DataParallel, NonFiniteGradients, initialize

STEPS, BATCH = 3, 4
OPT = {"adamw": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}},
       "lamb": {"type": "LAMB", "params": {"lr": 0.02, "weight_decay": 0.01}},
       "sgd": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}}


def make_model(width: int = 13) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(7, width), nn.Tanh(), nn.LayerNorm(width), nn.Linear(width, 5))
    m[2].bias.requires_grad_(False)  # a frozen parameter
    return m


class Swapped(nn.Module):
    """make_model's network, but its modules registered in another order than they run
    (stage 3 must prefetch along the execution order, not the registration order)."""

    def __init__(self):
        super().__init__()
        ref = make_model()
        self.second, self.norm, self.first = ref[3], ref[2], ref[0]

    def forward(self, x):
        return self.second(self.norm(torch.tanh(self.first(x))))

    RENAME = {"first": "0", "norm": "2", "second": "3"}


def data(rank: int, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + 100 * rank + micro)
    return torch.randn(BATCH, 7, generator=g), torch.randn(BATCH, 5, generator=g)


def reference(kind: str, world, steps: int, clip: float = 0.0, micro: int = 1) -> dict:
    """``world``: the world size, or one per step (a run resumed at another size)."""
    worlds = world if isinstance(world, list) else [world] * steps
    model = make_model()
    params = [p for p in model.parameters() if p.requires_grad]
    hp = OPT[kind]["params"]
    if kind == "adamw":
        opt = torch.optim.AdamW(params, foreach=False, **hp)
    elif kind == "sgd":
        opt = torch.optim.SGD(params, foreach=False, **hp)
    else:
        spec = optim.OptimSpec("lamb", **hp)
        states = [optim.init_state(spec, p) for p in params]
    for step in range(steps):
        xs, ys = zip(*(data(r, step, m) for m in range(micro) for r in range(worlds[step])))
        model.zero_grad()
        nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
        if clip:
            nn.utils.clip_grad_norm_(params, clip, foreach=False)
        if kind == "lamb":
            with torch.no_grad():
                for p, s in zip(params, states):
                    optim.step_(p.data, p.grad, s, spec, step + 1)
        else:
            opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def train(engine, rank: int, steps: int, micro: int = 1) -> None:
    for step in range(steps):
        for m in range(micro):
            x, y = data(rank, step, m)
            engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()


def compare(got: dict, ref: dict, what: str, atol: float = 1e-5) -> None:
    for name, want in ref.items():
        err = (got[name] - want).abs().max().item()
        if err > atol:
            raise AssertionError(f"{what}: {name} differs from single-process training by {err:.3g}")
    print(f"OK {what}", flush=True)


def engine_for(stage: int, kind: str, **extra):
    return initialize(make_model(), {"zero_optimization": {"stage": stage, "reduce_bucket_size": 40},
                                     "optimizer": OPT[kind], **extra})


def zero_cases(rank: int, world: int) -> None:
    for stage in (0, 1, 2, 3):
        for kind in ("adamw", "lamb"):
            engine = engine_for(stage, kind)
            train(engine, rank, STEPS)
            compare(engine.full_state_dict(), reference(kind, world, STEPS), f"stage {stage} {kind}")
            units = len(engine.zero.units)  # every unit's reduction started inside backward
            assert units > 1 and engine.reduced_during_backward == STEPS * units, (engine.reduced_during_backward, units)
        engine = engine_for(stage, "sgd", gradient_accumulation_steps=2, gradient_clipping=0.05)
        train(engine, rank, STEPS, micro=2)
        compare(engine.full_state_dict(), reference("sgd", world, STEPS, clip=0.05, micro=2),
                f"stage {stage} accumulation+clipping")


def bucket_view_case(rank: int, world: int) -> None:
    """Stage 0 leaves each p.grad a view of its bucket after a step, so later backwards
    accumulate there without a copy (torch DDP's gradient_as_bucket_view)."""
    engine = engine_for(0, "adamw")
    train(engine, rank, STEPS)
    compare(engine.full_state_dict(), reference("adamw", world, STEPS), "stage 0 gradients in the bucket")
    for u in engine.zero.units:
        for p, off in zip(u.params, u.layout.offsets):
            assert p.grad is not None and p.grad.data_ptr() == u.grad[off:].data_ptr(), "p.grad is not the bucket's"


def bf16_case(rank: int, world: int) -> None:
    """bf16 compute and communication, fp32 master weights: close to fp32 training."""
    for stage in (1, 3):
        engine = engine_for(stage, "sgd", bf16={"enabled": True})
        train(engine, rank, STEPS)
        got = engine.full_state_dict()
        assert all(v.dtype == torch.float32 for v in got.values())
        compare(got, reference("sgd", world, STEPS), f"stage {stage} bf16", atol=1e-2)


def swapped_case(rank: int, world: int) -> None:
    for prefetch in (0, 1, 50_000_000):  # none, one module ahead, everything ahead
        engine = initialize(Swapped(), {"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": prefetch},
                                        "optimizer": OPT["adamw"]})
        train(engine, rank, STEPS)
        got = {Swapped.RENAME[k.split(".")[0]] + "." + k.split(".")[1]: v
               for k, v in engine.full_state_dict().items()}
        compare(got, reference("adamw", world, STEPS), "stage 3 modules registered out of order")


def checkpoint_case(rank: int, world: int, directory: str) -> None:
    """Save after 2 steps at stage 2, resume at stage 3 for the last step: equals 3 straight steps."""
    engine = engine_for(2, "adamw")
    train(engine, rank, 2)
    engine.save_checkpoint(directory)
    resumed = engine_for(3, "adamw")
    resumed.load_checkpoint(directory)
    x, y = data(rank, 2)
    resumed.backward(nn.functional.mse_loss(resumed(x), y))
    resumed.step()
    compare(resumed.full_state_dict(), reference("adamw", world, 3), "checkpoint stage 2 -> stage 3")
    for stage in (1, 3):  # same world size and stage: bit-exact continuation, file or state_dict
        straight = engine_for(stage, "lamb")
        train(straight, rank, 3)
        first = engine_for(stage, "lamb")
        train(first, rank, 2)
        first.save_checkpoint(f"{directory}-s{stage}")
        state = first.state_dict()
        for how in ("file", "state_dict"):
            again = engine_for(stage, "lamb")
            if how == "file":
                again.load_checkpoint(f"{directory}-s{stage}")
            else:
                again.load_state_dict(state)
            x, y = data(rank, 2)
            again.backward(nn.functional.mse_loss(again(x), y))
            again.step()
            compare(again.full_state_dict(), straight.full_state_dict(), f"resume stage {stage} from {how}", atol=0)


def reshard_case(rank: int, world: int, directory: str) -> None:
    """Load a checkpoint written at another world size (values and optimizer state), go on."""
    engine = engine_for(1, "adamw")
    engine.load_checkpoint(directory)
    old_world = int(os.path.basename(glob.glob(os.path.join(directory, "save-*", "zero-rank*"))[0]).split("-of-")[1][:5])
    x, y = data(rank, 2)
    engine.backward(nn.functional.mse_loss(engine(x), y))
    engine.step()
    compare(engine.full_state_dict(), reference("adamw", [old_world, old_world, world], 3),
            f"resharded {old_world} -> {world} ranks")


def torn_case(rank: int, world: int, directory: str) -> None:
    """A save interrupted part-way leaves files of two steps, or a set whose save never finished:
    loading must refuse it on every rank, naming the files, never mix steps silently."""
    engine = engine_for(2, "adamw")
    train(engine, rank, 2)
    engine.save_checkpoint(f"{directory}-a")
    x, y = data(rank, 2)
    engine.backward(nn.functional.mse_loss(engine(x), y))
    engine.step()
    engine.save_checkpoint(f"{directory}-b")
    last = f"zero-rank{world - 1:05d}-of-{world:05d}.ckpt"
    if rank == 0:  # a crash mid-save: the last rank already wrote step 3 over step 2's set
        shutil.copytree(f"{directory}-a", f"{directory}-mixed")
        # (each set is its directory's first save: its rank files are in save-1)
        shutil.copy(os.path.join(f"{directory}-b", "save-1", last), os.path.join(f"{directory}-mixed", "save-1", last))
        os.makedirs(f"{directory}-unfinished")  # every shard written, but the save never completed
        for f in glob.glob(os.path.join(f"{directory}-b", "save-1", "zero-rank*.ckpt")):
            shutil.copy(f, f"{directory}-unfinished")
    commrt.barrier()
    for case, named in (("mixed", last), ("unfinished", "")):
        try:
            engine_for(2, "adamw").load_checkpoint(f"{directory}-{case}")
        except ConfigError as exc:
            assert named in str(exc) and f"{directory}-{case}" in str(exc), exc
            print(f"OK refused {case} checkpoint: {exc}", flush=True)
        else:
            raise AssertionError(f"the {case} checkpoint set was loaded")
    for case in ("a", "b"):  # the complete sets still load
        engine_for(2, "adamw").load_checkpoint(f"{directory}-{case}")


def memory_case(rank: int, world: int) -> None:
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    P = sum(p.numel() for p in model.parameters())
    expect = {1: 4 * P + 4 * P + 8 * P / world, 2: 4 * P + 12 * P / world, 3: 16 * P / world}
    for stage, want in expect.items():
        rep = initialize(model, {"zero_optimization": {"stage": stage}}).memory_report()
        got = rep["total"]
        if abs(got - want) > 0.03 * want:
            raise AssertionError(f"stage {stage} memory {rep} vs ZeRO accounting {want:.0f}")
        model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    print("OK memory accounting", flush=True)


def nonfinite_case(rank: int, world: int) -> None:
    for policy in ("skip", "raise"):
        engine = engine_for(2, "adamw", non_finite_grads=policy)
        before = engine.full_state_dict()
        x, y = data(rank, 0)
        if rank == world - 1:
            x[0, 0] = float("nan")
        engine.backward(nn.functional.mse_loss(engine(x), y))
        try:
            took = engine.step()
        except NonFiniteGradients as exc:
            assert policy == "raise" and f"rank(s) [{world - 1}]" in str(exc), exc
        else:
            assert policy == "skip" and not took and engine.skipped_steps == 1
        compare(engine.full_state_dict(), before, f"non-finite gradients: {policy}", atol=0)


def ddp_case(rank: int, world: int) -> None:
    model = DataParallel(make_model(), bucket_cap_mb=0.0001)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], foreach=False,
                            **OPT["adamw"]["params"])
    for step in range(STEPS):
        opt.zero_grad()
        x, y = data(rank, step)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    compare(dict(model.module.named_parameters()), reference("adamw", world, STEPS), "DataParallel")
    # every bucket's all-reduce was started by a gradient hook, i.e. while backward still ran
    assert len(model._buckets) > 1 and model.reduced_during_backward == STEPS * len(model._buckets), \
        (model.reduced_during_backward, len(model._buckets))
    model = DataParallel(make_model())
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], foreach=False, **OPT["sgd"]["params"])
    for step in range(STEPS):
        opt.zero_grad()
        with model.no_sync():
            x, y = data(rank, step, 0)
            (nn.functional.mse_loss(model(x), y) / 2).backward()
        x, y = data(rank, step, 1)
        (nn.functional.mse_loss(model(x), y) / 2).backward()
        opt.step()
    compare(dict(model.module.named_parameters()), reference("sgd", world, STEPS, micro=2), "DataParallel no_sync")
    ref = make_model()
    xs, ys = zip(*(data(r, 0) for r in range(world)))
    nn.functional.mse_loss(ref(torch.cat(xs)), torch.cat(ys)).backward()
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        model = DataParallel(make_model(), comm_dtype=dtype)
        x, y = data(rank, 0)
        nn.functional.mse_loss(model(x), y).backward()
        grads = {n: p.grad for n, p in model.module.named_parameters() if p.grad is not None}
        assert all(g.dtype == torch.float32 for g in grads.values())  # back in fp32 for accumulation
        compare(grads, {n: p.grad for n, p in ref.named_parameters() if p.grad is not None},
                f"DataParallel {name} gradients", atol=2e-2)


class Branchy(nn.Module):
    """Three linears of one size (one bucket each with a small cap: equal-sized all-reduces);
    ``b`` only where the caller says, ``frozen`` never."""

    def __init__(self, dtype_b: torch.dtype = torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(7, 5), nn.Linear(7, 5).to(dtype_b), nn.Linear(7, 5)
        self.frozen = nn.Linear(7, 5)

    def forward(self, x, use_b=True):
        return self.a(x) + (self.b(x.to(self.b.weight.dtype)).float() if use_b else 0) + self.c(x)


def branchy_grads(world: int, use, dtype_b=torch.float32, losses: int = 1) -> dict:
    model = Branchy(dtype_b)
    for _ in range(losses):
        loss = sum(nn.functional.mse_loss(model(data(r, 0)[0], use(r)), data(r, 0)[1]) for r in range(world))
        (loss / world).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def ddp_edge_case(rank: int, world: int) -> None:
    """Found by the training review: a parameter only some ranks use (its bucket used to start
    later there, so equal-sized buckets were averaged crosswise, without an error); one no rank
    uses, or frozen after wrapping (got a zero p.grad, which AdamW's decay and moments move);
    an fp32 gradient in a bucket whose first parameter is bf16 (reduced in bf16); two backwards
    of one forward (the second was never reduced: replicas diverged)."""
    cap = 40 * 4 / (1 << 20)  # 40 elements: one linear (35) per bucket
    model = DataParallel(Branchy(), bucket_cap_mb=cap)
    model.module.frozen.requires_grad_(False)
    use = lambda r: r % 2 == 0  # noqa: E731
    x, y = data(rank, 0)
    nn.functional.mse_loss(model(x, use(rank)), y).backward()
    got = {n: p.grad for n, p in model.module.named_parameters()}
    want = branchy_grads(world, use)
    assert got["frozen.weight"] is None and got["frozen.bias"] is None, "a frozen parameter got a gradient"
    compare({n: g for n, g in got.items() if g is not None}, {n: g for n, g in want.items() if g is not None},
            "DataParallel parameter unused on some ranks", atol=1e-6)
    model = DataParallel(Branchy(), bucket_cap_mb=cap)
    nn.functional.mse_loss(model(x, False), y).backward()
    assert model.module.b.weight.grad is None, "a parameter no rank used got a gradient"
    model = DataParallel(Branchy(torch.bfloat16))
    assert len(model._buckets) == 1
    nn.functional.mse_loss(model(x), y).backward()
    want = branchy_grads(world, lambda r: True, torch.bfloat16)
    compare({n: p.grad for n, p in model.module.named_parameters() if p.dtype == torch.float32 and p.grad is not None},
            {n: g for n, g in want.items() if "frozen" not in n and "b." not in n}, "DataParallel mixed dtypes", atol=1e-6)
    model = DataParallel(Branchy(), bucket_cap_mb=cap)
    out = model(x)
    for _ in range(2):
        nn.functional.mse_loss(out, y).backward(retain_graph=True)
    want = branchy_grads(world, lambda r: True, losses=2)
    compare({n: p.grad for n, p in model.module.named_parameters() if p.grad is not None},
            {n: g for n, g in want.items() if g is not None}, "DataParallel two backwards of one forward", atol=1e-6)
    for bad in ({"bucket_cap_mb": -1}, {"bucket_cap_mb": "25"}, {"comm_dtype": torch.int8}):
        try:
            DataParallel(Branchy(), **bad)
        except ConfigError:
            pass
        else:
            raise AssertionError(f"DataParallel accepted {bad}")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(7, 5), nn.BatchNorm1d(5))
    fresh = copy.deepcopy(net)
    model = DataParallel(net)
    if rank == 0:  # evaluation on one rank: no collective (its buffer broadcast met the others' forward)
        with torch.no_grad():
            model(x)
    nn.functional.mse_loss(model(x), y).backward()
    want = {n: torch.zeros_like(p) for n, p in fresh.named_parameters()}
    for r in range(world):  # BatchNorm normalises each rank's batch: the average of per-rank gradients
        ref = copy.deepcopy(fresh)
        nn.functional.mse_loss(ref(data(r, 0)[0]), data(r, 0)[1]).backward()
        for n, p in ref.named_parameters():
            want[n] += p.grad / world
    compare({n: p.grad for n, p in model.module.named_parameters()}, want,
            "DataParallel evaluation on one rank", atol=1e-6)


def engine_unused_case(rank: int, world: int) -> None:
    """Found by the training review: a parameter only some ranks' forward uses completed its unit
    at the end of backward there, so stages 0-2 started equal-sized units' reductions in another
    order on those ranks and averaged them crosswise (a.weight off by 0.08, no error)."""
    use = lambda r: r % 2 == 0  # noqa: E731
    for stage in (0, 1, 2):
        engine = initialize(Branchy(), {"zero_optimization": {"stage": stage, "reduce_bucket_size": 40},
                                        "optimizer": OPT["sgd"]})
        x, y = data(rank, 0)
        engine.backward(nn.functional.mse_loss(engine(x, use(rank)), y))
        engine.step()
        ref, grads = Branchy(), branchy_grads(world, use)
        with torch.no_grad():
            for n, p in ref.named_parameters():  # the engine steps every parameter, unused ones included
                if grads[n] is not None:
                    p.add_(grads[n], alpha=-OPT["sgd"]["params"]["lr"])
        compare(engine.full_state_dict(), dict(ref.named_parameters()),
                f"stage {stage} parameter unused on some ranks", atol=1e-6)


def overlap_case(rank: int, world: int) -> None:
    """Issue 29.4: the overlapped paths give what the unoverlapped ones give (within 1e-6) and
    what plain torch gives. DataParallel: a bucket per parameter, each all-reduced from its
    gradient hook during backward, against one bucket (reduced once the last gradient is in).
    Stage 3: gathers prefetched one module ahead and reductions left in flight, against no
    prefetch and every collective waited for where it starts (overlap_comm false)."""
    trained = {}
    for name, cap in (("overlapped", 0.0001), ("one bucket", 1000.0)):
        model = DataParallel(make_model(), bucket_cap_mb=cap)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], foreach=False,
                                **OPT["adamw"]["params"])
        for step in range(STEPS):
            opt.zero_grad()
            x, y = data(rank, step)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        trained[name] = (model, dict(model.module.named_parameters()))
    assert len(trained["overlapped"][0]._buckets) > 2 and len(trained["one bucket"][0]._buckets) == 1
    compare(trained["overlapped"][1], trained["one bucket"][1], "DataParallel overlapped = one bucket", atol=1e-6)
    compare(trained["overlapped"][1], reference("adamw", world, STEPS), "DataParallel overlapped = torch")
    engines = {}
    for name, zero in (("overlapped", {"stage": 3}),
                       ("serial", {"stage": 3, "overlap_comm": False, "stage3_prefetch_bucket_size": 0})):
        engine = initialize(make_model(), {"zero_optimization": zero, "optimizer": OPT["adamw"]})
        train(engine, rank, STEPS)
        engines[name] = engine
    # 3 units; from the second step on (the order is learned), 2 prefetched in forward and 2 in backward
    want = 0 if world == 1 else 4 * (STEPS - 1)  # one rank: the parameters view the master, no gathers
    assert engines["overlapped"].prefetched == want and engines["serial"].prefetched == 0, \
        (engines["overlapped"].prefetched, engines["serial"].prefetched)
    got = engines["overlapped"].full_state_dict()
    compare(got, engines["serial"].full_state_dict(), "stage 3 prefetched = serial", atol=1e-6)
    compare(got, reference("adamw", world, STEPS), "stage 3 prefetched = torch")


def transformer_case(rank: int, world: int) -> None:
    """torch's own encoder layer (nn.MultiheadAttention reads out_proj.weight without calling
    out_proj): ZeRO-3 and hpZ equal single-process training on the global batch (issue 30.16);
    and ZeRO++ hybrid (qgZ, replica all-reduce chained on the comm stream, issue 30.22) gives
    the same values with the stream as without it."""
    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True), nn.Linear(8, 5))

    def batch(r, step):
        g = torch.Generator().manual_seed(1000 * step + r)
        return torch.randn(2, 3, 8, generator=g), torch.randn(2, 3, 5, generator=g)

    ref = model()
    # SGD: the key bias gets a zero gradient up to rounding, which Adam would scale up to lr
    opt = torch.optim.SGD(ref.parameters(), foreach=False, **OPT["sgd"]["params"])
    for step in range(STEPS):
        xs, ys = zip(*(batch(r, step) for r in range(world)))
        opt.zero_grad()
        nn.functional.mse_loss(ref(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    want = {n: p.detach() for n, p in ref.named_parameters()}
    runs = {"stage 3 transformer": {"stage": 3}, "hpZ transformer": {"stage": 3, "zero_hpz_partition_size": world},
            "hybrid qgZ stream": {"stage": 3, "sharding_strategy": "HYBRID_SHARD", "shard_group_size": 1,
                                  "zero_quantized_gradients": True, "overlap_comm": True},
            "hybrid qgZ serial": {"stage": 3, "sharding_strategy": "HYBRID_SHARD", "shard_group_size": 1,
                                  "zero_quantized_gradients": True, "overlap_comm": False}}
    got = {}
    for what, zero in runs.items():
        engine = initialize(model(), {"zero_optimization": zero, "optimizer": OPT["sgd"]})
        for step in range(STEPS):
            x, y = batch(rank, step)
            engine.backward(nn.functional.mse_loss(engine(x), y))
            engine.step()
        got[what] = engine.full_state_dict()
    compare(got["stage 3 transformer"], want, "stage 3 transformer")
    compare(got["hpZ transformer"], want, "hpZ transformer")
    compare(got["hybrid qgZ stream"], got["hybrid qgZ serial"], "hybrid qgZ stream = serial", atol=0)


def main() -> int:
    torch.set_num_threads(1)
    commrt.init_process_group()
    rank, world = commrt.get_rank(), commrt.get_world_size()
    which = sys.argv[1:] or ["zero", "checkpoint", "memory", "nonfinite", "ddp", "overlap"]
    if "zero" in which:
        zero_cases(rank, world)
    if "zero" in which:
        swapped_case(rank, world)
        bucket_view_case(rank, world)
        bf16_case(rank, world)
        engine_unused_case(rank, world)
    if "checkpoint" in which:
        directory = os.path.join(os.environ.get("COMMRT_TEST_TMP", tempfile.gettempdir()), f"ckpt-{world}")
        checkpoint_case(rank, world, directory)
    if "torn" in which:
        torn_case(rank, world, os.path.join(os.environ["COMMRT_TEST_TMP"], f"torn-{world}"))
    if "reshard" in which:
        reshard_case(rank, world, os.path.join(os.environ["COMMRT_TEST_TMP"], f"ckpt-{world}"))
    if "transformer" in which:
        transformer_case(rank, world)
    if "memory" in which:
        memory_case(rank, world)
    if "nonfinite" in which:
        nonfinite_case(rank, world)
    if "ddp" in which:
        ddp_case(rank, world)
        ddp_edge_case(rank, world)
    if "overlap" in which:
        overlap_case(rank, world)
    commrt.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
