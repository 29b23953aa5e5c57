"""What the torch.distributed layer costs: all_reduce through ``torch.distributed`` on backend
"commrt" against commrt's own ``commrt.all_reduce``, in the same ranks, alternating sample by
sample (so load changes hit both alike); and a DDP training step on "commrt" against gloo.

    flock /work/notes/bench.lock commrt launch -n 2 -- python -m workers.tdist_bench [--iters 30]

Prints per size the median time of each path and their ratio (torch API / own API), then the
median DDP step time of each backend and their ratio (commrt / gloo).
"""
from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import commrt

from commrt.apps import reporter
from commrt.runtime import torch_init

SIZES = {"4KiB": 4 << 10, "64MiB": 64 << 20}


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def overhead(group, iters: int, log) -> None:
    for label, nbytes in SIZES.items():
        t = torch.ones(nbytes // 4)
        n = iters if nbytes < (1 << 20) else max(3, iters // 6)
        own, via_torch = [], []
        for _ in range(3):  # warm-up: connections, buffers
            commrt.all_reduce(t)
            dist.all_reduce(t, group=group)
        for _ in range(n):  # alternate the two paths sample by sample
            commrt.barrier()
            own.append(_time(lambda: commrt.all_reduce(t)))
            dist.barrier(group=group)
            via_torch.append(_time(lambda: dist.all_reduce(t, group=group)))
        a, b = statistics.median(own), statistics.median(via_torch)
        log.info("all_reduce %6s: own API %9.1f us, torch API on 'commrt' %9.1f us, ratio %.3f",
                 label, a * 1e6, b * 1e6, b / a)


def _ddp_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 512))


def ddp_steps(group, iters: int, log) -> None:
    """One DDP model on the default (gloo) group, one on the "commrt" group; steps alternate."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    x, y = torch.randn(32, 512), torch.randn(32, 512)
    steps, times = {}, {"gloo": [], "commrt": []}
    for name, pg in (("gloo", None), ("commrt", group)):
        m = DDP(_ddp_model(), process_group=pg)
        opt = torch.optim.SGD(m.parameters(), lr=0.01)

        def step(m=m, opt=opt):
            opt.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            opt.step()
        steps[name] = step
    for _ in range(3):
        for step in steps.values():
            step()
    for _ in range(iters):
        for name, step in steps.items():
            dist.barrier()
            times[name].append(_time(step))
    g, c = statistics.median(times["gloo"]), statistics.median(times["commrt"])
    log.info("DDP step (%.1fM parameters, world %d): gloo %.1f ms, commrt %.1f ms, ratio %.3f",
             sum(p.numel() for p in _ddp_model().parameters()) / 1e6, dist.get_world_size(), g * 1e3, c * 1e3,
             c / g)


def gloo_world(rank: int, world: int) -> None:
    """torch's default group on gloo, its TCPStore served by rank 0 on MASTER_ADDR only (on a
    free port told through commrt's broadcast), gloo on the interface commrt advertises."""
    store = torch_init.shared_store(rank, 120.0, commrt.broadcast)
    with torch_init.gloo_interface(commrt.get_config()):
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="torch API on 'commrt' vs commrt's own API; DDP vs gloo")
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args(argv)
    commrt.init_process_group(backend="zmq")
    rank, world = commrt.get_rank(), commrt.get_world_size()
    log = reporter(__name__, f"rank {rank}") if rank == 0 else logging.getLogger("quiet")
    gloo_world(rank, world)
    group = dist.new_group(backend="commrt")
    overhead(group, args.iters, log)
    ddp_steps(group, args.iters, log)
    dist.destroy_process_group()
    commrt.barrier()
    commrt.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
