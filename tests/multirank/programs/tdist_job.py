"""torch.distributed training on backend "commrt" against gloo and a single process (issue 18).

Every case trains the same model from the same seed for STEPS optimizer steps, once on gloo and
once on commrt (one torch TCPStore on MASTER_PORT serves both inits, prefixed), and rank 0
trains it alone on the whole batch. Prints 'OK <case>' per case on every rank.
Usage: python -m tests.multirank.programs.tdist_job CASE [CASE ...]
cases: ddp, ddp_no_sync, ddp_bf16, ddp_powersgd, fsdp, fsdp_keep, hsdp, pipe, monitored
"""
from __future__ import annotations

import datetime
import os
import re
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import commrt  # noqa: F401 (registers the "commrt" backend)

STEPS, BATCH, DIM = 4, 8, 16
GLOO_TOL, SINGLE_TOL, BF16_TOL = 1e-6, 1e-5, 1e-3


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, 4, generator=g)


def _loss(m, x, y):
    return nn.functional.mse_loss(m(x), y)


def single_process(world: int, steps: int = STEPS) -> list[torch.Tensor]:
    """The whole batch (every rank's rows) on one process: what data parallelism must equal."""
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for s in range(steps):
        parts = [batch(s, r) for r in range(world)]
        x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        opt.zero_grad()
        _loss(m, x, y).backward()
        opt.step()
    return [p.detach().clone() for p in m.parameters()]


def _full(p) -> torch.Tensor:
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()


def bf16_hook(state, bucket):
    """torch's bf16_compress_hook (bucket -> bf16 -> all_reduce -> fp32, on the future); DDP
    refuses that function by name off CUDA/NCCL, so its body is called directly."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    return default_hooks._compress_hook(torch.bfloat16, state, bucket)


def train_ddp(case: str, rank: int) -> list[torch.Tensor]:
    from torch.nn.parallel import DistributedDataParallel as DDP
    m = DDP(model())
    if case == "ddp_bf16":
        m.register_comm_hook(None, bf16_hook)
    if case == "ddp_powersgd":  # its callbacks wait on further all_reduces of the group
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
        m.register_comm_hook(psgd.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2),
                             psgd.powerSGD_hook)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for s in range(STEPS):
        x, y = batch(s, rank)
        opt.zero_grad()
        if case == "ddp_no_sync":  # half the batch accumulated locally, the other half synced
            with m.no_sync():
                (_loss(m, x[:BATCH // 2], y[:BATCH // 2]) / 2).backward()
            (_loss(m, x[BATCH // 2:], y[BATCH // 2:]) / 2).backward()
        else:
            _loss(m, x, y).backward()
        opt.step()
    return [_full(p) for p in m.module.parameters()]


def train_fsdp(case: str, rank: int, world: int) -> list[torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    m = model()
    if case == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    keep = case == "fsdp_keep"
    for layer in (m[0], m[2], m[4]):
        fully_shard(layer, mesh=mesh, reshard_after_forward=not keep)
    fully_shard(m, mesh=mesh, reshard_after_forward=not keep)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for s in range(STEPS):
        x, y = batch(s, rank)
        opt.zero_grad()
        _loss(m, x, y).backward()
        opt.step()
    return [_full(p) for p in m.parameters()]


def train_pipe(rank: int, world: int) -> list[torch.Tensor]:
    """2-stage GPipe over the whole batch of 4 micro-batches (ranks 0-1; the rest idle)."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
    full = model()
    part = nn.Sequential(*list(full)[:2]) if rank == 0 else nn.Sequential(*list(full)[2:])
    stage = PipelineStage(part, rank, 2, torch.device("cpu"))
    sched = ScheduleGPipe(stage, n_microbatches=4, loss_fn=nn.functional.mse_loss)
    opt = torch.optim.SGD(part.parameters(), lr=0.1)
    for s in range(STEPS):
        parts = [batch(s, r) for r in range(world)]
        x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        opt.zero_grad()
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y)
        opt.step()
    return [p.detach().clone() for p in part.parameters()]


def monitored(rank: int, world: int) -> list[torch.Tensor]:
    """torch's dist.monitored_barrier at 3+ ranks, the same checks on gloo and commrt (torch
    itself refuses non-gloo groups; commrt routes its groups to their own): all pass; one rank
    absent (rank 0 names it, the rank that arrived says rank 0 never released it); two absent
    with wait_all_ranks (both named); rank 0's own time out (timeout 0); a subgroup whose absent
    member is named while a non-member's call does nothing. Each case on a fresh group, so no
    token of one reaches the next."""
    def expect(pattern: str, call) -> None:
        try:
            call()
        except RuntimeError as exc:
            assert re.search(pattern, str(exc)), f"{pattern!r} not in {exc!r}"
            return
        raise AssertionError(f"monitored_barrier passed; expected {pattern!r}")

    sec = datetime.timedelta(seconds=1.5)
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=30), wait_all_ranks=True)
    g = dist.new_group()
    if rank == 0:
        expect(f"Rank {world - 1} failed to pass monitoredBarrier", lambda: dist.monitored_barrier(g, sec))
    elif rank < world - 1:
        expect(f"Rank {rank} successfully reached monitoredBarrier, but received errors while waiting for "
               "send/recv from rank 0", lambda: dist.monitored_barrier(g, sec))
    g = dist.new_group()
    if rank == 0:
        absent = ", ".join(str(r) for r in range(1, world))
        expect(f"Ranks {absent} failed to pass monitoredBarrier",
               lambda: dist.monitored_barrier(g, datetime.timedelta(seconds=0.5), wait_all_ranks=True))
    g = dist.new_group()
    if rank == 0:
        expect("Rank 0 timed out in monitoredBarrier", lambda: g.monitored_barrier(datetime.timedelta(0)))
    g = dist.new_group([0, 1])
    if rank == 0:
        expect("Rank 1 failed to pass monitoredBarrier", lambda: dist.monitored_barrier(g, sec))
    elif rank > 1:
        dist.monitored_barrier(g, sec)  # not a member: returns at once
    return []


def run(case: str, rank: int, world: int) -> list[torch.Tensor]:
    if case == "monitored":
        return monitored(rank, world)
    if case.startswith("ddp"):
        return train_ddp(case, rank)
    if case == "pipe":
        return train_pipe(rank, world)
    return train_fsdp(case, rank, world)


def close(a: list[torch.Tensor], b: list[torch.Tensor], tol: float, what: str) -> None:
    assert len(a) == len(b), f"{what}: {len(a)} vs {len(b)} parameters"
    for i, (x, y) in enumerate(zip(a, b)):
        diff = (x - y).abs().max().item()
        assert diff <= tol, f"{what}: parameter {i} differs by {diff:.3g} (tolerance {tol:g})"


def subgroups(rank: int, world: int) -> None:
    """new_group(backend="commrt") on every other rank: group ranks differ from global ones (each
    creator call gets a prefixed store and its members' global ranks); src/dst are global."""
    members = list(range(0, world, 2))
    sub = dist.new_group(members, backend="commrt")
    if rank in members:
        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t, group=sub)
        assert t.tolist() == [float(sum(r + 1 for r in members))] * 3, t
        b = torch.full((2,), float(rank))
        dist.broadcast(b, src=members[-1], group=sub)
        assert b.tolist() == [float(members[-1])] * 2, b
        assert dist.get_backend(sub) == "commrt" and dist.get_rank(sub) == members.index(rank)
    print(f"OK subgroups rank {rank}", flush=True)


def group_timeout(rank: int) -> None:
    """new_group(timeout=1s): its barrier, which only rank 0 enters, fails on rank 0 after about
    that timeout (plus the heartbeats' grace to name a frozen peer), not the world's."""
    sub = dist.new_group(backend="commrt", timeout=datetime.timedelta(seconds=1))
    if rank == 0:
        start = time.monotonic()
        try:
            dist.barrier(group=sub)
            raise AssertionError("a barrier nobody else entered succeeded")
        except commrt.PeerLost as exc:
            took = time.monotonic() - start
            assert "timeout after 1s" in str(exc) and took < 8, (took, exc)  # the world's is 10 s
            print(f"OK group timeout after {took:.1f}s: {exc}", flush=True)


def faults(case: str, rank: int, world: int) -> None:
    """peerlost: the last rank leaves after init; the others' all_reduce raises commrt's PeerLost
    naming it, through torch's API. wrongsecret: the last rank has another job secret, so its
    data-plane connections are refused and init fails on the ranks (no one hangs)."""
    last = world - 1
    if case == "wrongsecret" and rank == last:
        os.environ["COMMRT_JOB_SECRET"] = "another-secret-of-16+chars"
    try:
        dist.init_process_group("commrt")
    except commrt.CommError as exc:
        assert case == "wrongsecret", exc
        print(f"OK {case} init refused: {type(exc).__name__}: {exc}", flush=True)
        os._exit(0)
    assert case == "peerlost", "init with a wrong secret succeeded"
    from tests.multirank.programs.tdist_ops import check_all
    check_all(rank, world)
    subgroups(rank, world)
    group_timeout(rank)
    dist.barrier()  # every connection is up and used ...
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        store.set("passed", "1")  # ... and rank 0 has had the last rank's barrier message
    if rank == last:
        store.wait(["passed"])
        os._exit(0)  # gone without a word
    try:
        dist.all_reduce(torch.ones(4))
    except commrt.PeerLost as exc:
        assert exc.rank == last, exc
        print(f"OK {case} rank {rank}: {exc}", flush=True)
        os._exit(0)
    raise AssertionError("all_reduce with a dead peer succeeded")


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if sys.argv[1] in ("peerlost", "wrongsecret"):
        return faults(sys.argv[1], rank, world)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0,
                          timeout=datetime.timedelta(seconds=60))
    gloo_groups = []  # kept to the end: see the comment below
    for n, case in enumerate(sys.argv[1:]):
        results = {}
        for backend in ("gloo", "commrt"):
            dist.init_process_group(backend, store=dist.PrefixStore(f"{case}/{n}/{backend}", store),
                                    rank=rank, world_size=world)
            results[backend] = run(case, rank, world)
            if backend == "gloo":
                # torch's PowerSGD hook keeps the group in its ``then`` callbacks' closures; gloo
                # runs and frees those on its worker thread, which can then drop the group's last
                # reference: ~ProcessGroupGloo joined that very thread and the rank aborted
                # (std::system_error "Resource deadlock avoided", seen from the second case of a
                # process on; torch 2.13, gloo alone too). Held here, main() frees it, on this thread.
                gloo_groups.append(dist.group.WORLD)
            dist.destroy_process_group()
        # bf16 sums of more than two terms round by summation order, which differs from gloo's
        tol = GLOO_TOL if case != "ddp_bf16" or world == 2 else BF16_TOL
        close(results["commrt"], results["gloo"], tol, f"{case}: commrt vs gloo")
        if case == "pipe":
            ref = single_process(world)
            mine = ref[:2] if rank == 0 else ref[2:]
            close(results["commrt"], mine, SINGLE_TOL, f"{case}: commrt vs one process")
        elif case not in ("ddp_bf16", "ddp_powersgd", "monitored"):  # compression is not meant to equal fp32
            close(results["commrt"], single_process(world), SINGLE_TOL, f"{case}: commrt vs one process")
        print(f"OK {case}", flush=True)
    store.add("done", 1)  # rank 0 serves the store: it leaves last
    deadline = time.monotonic() + 60
    while rank == 0 and store.add("done", 0) < world and time.monotonic() < deadline:
        time.sleep(0.05)  # polling the store's counter, bounded: not a timing assumption


if __name__ == "__main__":
    main()
