"""Hybrid sharding (FSDP HYBRID_SHARD, _HYBRID_SHARD_ZERO2, DeepSpeed MiCS) and ZeRO++ hpZ
against single-process training on the global batch, with shard groups of SHARD ranks forced by
configuration (loopback has no nodes). Prints 'OK <case>' per check or raises."""
from __future__ import annotations

import os
import sys

import torch
from torch import nn

import commrt
from commrt import distributed as dist
from commrt.runtime.errors import ConfigError
from commrt.train import initialize
from tests.multirank.programs.zero_job import OPT, STEPS, compare, data, make_model, reference, train

SHARD = int(os.environ.get("COMMRT_TEST_SHARD", "2"))
LAYOUTS = {"FULL_SHARD": {"sharding_strategy": "FULL_SHARD"},
           "SHARD_GRAD_OP": {"sharding_strategy": "SHARD_GRAD_OP"},
           "NO_SHARD": {"sharding_strategy": "NO_SHARD"},
           "HYBRID_SHARD": {"sharding_strategy": "HYBRID_SHARD", "shard_group_size": SHARD},
           "_HYBRID_SHARD_ZERO2": {"sharding_strategy": "_HYBRID_SHARD_ZERO2", "shard_group_size": SHARD},
           "MiCS": {"stage": 3, "mics_shard_size": SHARD},
           "hpZ": {"stage": 3, "zero_hpz_partition_size": SHARD}}


def engine_for(layout: str, kind: str, model=None, **extra):
    zero = {**LAYOUTS[layout], "reduce_bucket_size": 40, **extra.pop("zero", {})}
    return initialize(model or make_model(), {"zero_optimization": zero, "optimizer": OPT[kind], **extra})


def strategy_cases(rank: int, world: int, layouts, kinds=("adamw", "lamb")) -> None:
    for layout in layouts:
        for kind in kinds:
            engine = engine_for(layout, kind)
            train(engine, rank, STEPS)
            compare(engine.full_state_dict(), reference(kind, world, STEPS), f"{layout} {kind}")
        engine = engine_for(layout, "sgd", gradient_accumulation_steps=2, gradient_clipping=0.05)
        train(engine, rank, STEPS, micro=2)
        compare(engine.full_state_dict(), reference("sgd", world, STEPS, clip=0.05, micro=2),
                f"{layout} accumulation+clipping")
    for prefetch in (0, 50_000_000):  # hpZ's gathers switch source under prefetch too
        engine = engine_for("hpZ", "adamw", zero={"stage3_prefetch_bucket_size": prefetch})
        train(engine, rank, STEPS)
        compare(engine.full_state_dict(), reference("adamw", world, STEPS), f"hpZ prefetch {prefetch}")


def overlap_step_case(rank: int, world: int) -> None:
    """HYBRID_SHARD's overlapped step (zero_defer: held replica all-reduces, each unit stepped at
    its next gather) against the unoverlapped one, bit for bit, and against single-process
    training, with and without gradient accumulation; it must really have deferred."""
    for micro in (1, 2):
        states = {}
        for overlap in (True, False):
            engine = engine_for("HYBRID_SHARD", "adamw", zero={"overlap_step": overlap},
                                gradient_accumulation_steps=micro)
            train(engine, rank, STEPS, micro=micro)
            z = engine.zero
            if overlap and not (z.defer and z.late and z.deferred_steps == STEPS and z.steps_in_forward > 0):
                raise AssertionError(f"overlap_step did not defer: held {len(z.late)} of {len(z.units)} units, "
                                     f"{z.deferred_steps} deferred steps, {z.steps_in_forward} stepped in forward")
            states[overlap] = engine.full_state_dict()
        for name, want in states[False].items():
            if not torch.equal(states[True][name], want):
                raise AssertionError(f"overlap_step micro {micro}: {name} differs from the unoverlapped step by "
                                     f"{(states[True][name] - want).abs().max().item():.3g}")
        compare(states[True], reference("adamw", world, STEPS, micro=micro), f"HYBRID_SHARD overlap_step micro {micro}")


def error_cases(rank: int, world: int) -> None:
    """Group sizes that do not fit the world fail on every rank before any collective (the
    later cases still run on the same world group: nothing was left half-done)."""
    for zero, says in (({"sharding_strategy": "HYBRID_SHARD", "shard_group_size": 2 * world}, "larger than the world"),
                       ({"stage": 3, "zero_hpz_partition_size": world - 1}, "does not divide the world")):
        try:
            initialize(make_model(), {"zero_optimization": zero})
        except ConfigError as exc:
            assert says in str(exc), exc
            print(f"OK refused {zero}: {exc}", flush=True)
        else:
            raise AssertionError(f"{zero} was accepted at world {world}")


def memory_case(rank: int, world: int) -> None:
    """hpZ holds stage 3's state plus the secondary copy (4 bytes x P / SHARD in fp32); hybrid
    stage 3 holds stage 3's state over SHARD ranks instead of the world (16 P / SHARD)."""
    def report(layout):
        torch.manual_seed(0)
        return initialize(nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)]),
                          {"zero_optimization": LAYOUTS[layout]}).memory_report()
    P = 6 * (64 * 64 + 64)
    full, hpz, hybrid = report("FULL_SHARD"), report("hpZ"), report("HYBRID_SHARD")
    extra = hpz["parameters"] - full["parameters"]
    if abs(extra - 4 * P / SHARD) > 0.03 * 4 * P / SHARD or hpz["total"] - full["total"] != extra:
        raise AssertionError(f"hpZ {hpz} vs stage 3 {full}: the secondary copy should add {4 * P / SHARD:.0f}")
    if abs(hybrid["total"] - 16 * P / SHARD) > 0.03 * 16 * P / SHARD:
        raise AssertionError(f"HYBRID_SHARD {hybrid} vs {16 * P / SHARD:.0f}")
    print("OK memory accounting", flush=True)


def checkpoint_cases(rank: int, world: int, directory: str) -> None:
    """Save after 2 steps under one layout, take the third step under another: equals 3 steps."""
    for saved, loaded in (("HYBRID_SHARD", "hpZ"), ("hpZ", "_HYBRID_SHARD_ZERO2"), ("MiCS", "FULL_SHARD"),
                          ("_HYBRID_SHARD_ZERO2", "HYBRID_SHARD")):
        engine = engine_for(saved, "adamw")
        train(engine, rank, 2)
        path = os.path.join(directory, f"{saved}-{loaded}")
        engine.save_checkpoint(path)
        resumed = engine_for(loaded, "adamw")
        resumed.load_checkpoint(path)
        x, y = data(rank, 2)
        resumed.backward(nn.functional.mse_loss(resumed(x), y))
        resumed.step()
        compare(resumed.full_state_dict(), reference("adamw", world, 3), f"checkpoint {saved} -> {loaded}")


def convergence_case(rank: int, world: int) -> None:
    """DeepSpeed 4851: hpZ that trains but does not converge. Over many steps on a fixed batch,
    hpZ's losses must follow plain stage 3's and fall."""
    losses = {}
    for layout in ("FULL_SHARD", "hpZ"):
        engine = engine_for(layout, "adamw")
        x, y = data(rank, 0)
        seen = []
        for _ in range(40):
            loss = nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean, commrt.ReduceOp.AVG)
            seen.append(float(mean))
        losses[layout] = seen
    full, hpz = losses["FULL_SHARD"], losses["hpZ"]
    worst = max(abs(a - b) for a, b in zip(full, hpz))
    if worst > 1e-5 or not hpz[-1] < 0.5 * hpz[0]:
        raise AssertionError(f"hpZ losses {hpz[::8]} vs stage 3 {full[::8]} (worst gap {worst:.3g})")
    print(f"OK hpZ converges like stage 3: loss {hpz[0]:.4f} -> {hpz[-1]:.4f}", flush=True)


def step_bytes(layout: str, rank: int, world: int) -> tuple[int, int]:
    """Bytes all ranks together sent to peers inside their own shard group, and outside it, in one
    training step (after a warm-up step) of a model whose every unit is sent directly (< small_bytes)."""
    torch.manual_seed(0)
    engine = engine_for(layout, "sgd", model=nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)]))
    counters = dist._rt().transport.counters

    def one_step(step):
        g = torch.Generator().manual_seed(step * 100 + rank)
        x, y = torch.randn(4, 64, generator=g), torch.randn(4, 64, generator=g)
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
        engine.settle()  # overlap_step: the step's replica all-reduces may still be crossing

    one_step(0)
    before = counters.snapshot()
    one_step(1)
    after = counters.snapshot()
    inside = outside = 0
    for peer, c in after.items():
        if peer.startswith("rank"):
            sent = c["sent_bytes"] - before.get(peer, {}).get("sent_bytes", 0)
            if int(peer[4:]) // SHARD == rank // SHARD:
                inside += sent
            else:
                outside += sent
    total = torch.tensor([inside, outside], dtype=torch.float64)
    dist.all_reduce(total)
    return int(total[0]), int(total[1])


def bytes_case(rank: int, world: int) -> None:
    """Per step, with units sent directly (each rank to each peer): stage 3's forward gather,
    backward gather and gradient reduce-scatter each leave the group; hpZ's backward gather
    stays inside; hybrid sends only the all-reduce of each shard over its replicas."""
    got = {layout: step_bytes(layout, rank, world) for layout in ("FULL_SHARD", "hpZ", "HYBRID_SHARD")}
    P = 4 * (64 * 64 + 64) * 4  # parameter bytes (no padding at this size)
    per_op = P * (world - SHARD)  # each rank sends P / world to each of its world - SHARD outside peers
    hybrid = world * (P // SHARD) * (world // SHARD - 1)  # the shard to each other replica
    want = {"FULL_SHARD": 3 * per_op, "hpZ": 2 * per_op, "HYBRID_SHARD": hybrid}
    for layout, (inside, outside) in got.items():
        if abs(outside - want[layout]) > 0.01 * want[layout]:  # beyond the payload: headers
            raise AssertionError(f"{layout}: {outside} bytes per step left the shard groups, expected about "
                                 f"{want[layout]}; all: {got}")
    print(f"OK bytes per step off the shard group {got}", flush=True)


def main() -> int:
    torch.set_num_threads(1)
    commrt.init_process_group()
    rank, world = commrt.get_rank(), commrt.get_world_size()
    which = sys.argv[1:] or ["strategies", "checkpoint", "convergence"]
    if "strategies" in which:
        strategy_cases(rank, world, list(LAYOUTS))
    if "hybrid" in which:  # the fast tier: the layouts with groups, one optimizer
        strategy_cases(rank, world, ["HYBRID_SHARD", "_HYBRID_SHARD_ZERO2", "MiCS", "hpZ"], ("adamw",))
        overlap_step_case(rank, world)
    if "overlap" in which:
        overlap_step_case(rank, world)
    if "errors" in which:
        error_cases(rank, world)
        memory_case(rank, world)
    if "checkpoint" in which:
        checkpoint_cases(rank, world, os.environ["COMMRT_TEST_TMP"])
    if "convergence" in which:
        convergence_case(rank, world)
    if "bytes" in which:
        bytes_case(rank, world)
    if "defer" in which:  # programs/defer_job.py's cases on this world: one launch of 4 ranks less
        from tests.multirank.programs import defer_job
        defer_job.cases(rank, os.environ["COMMRT_TEST_TMP"])
    commrt.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
