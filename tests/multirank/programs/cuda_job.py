"""CUDA tensors through commrt, every result compared with a CPU reference.

    cuda_job nccl   (world size 1: NCCL on the one GPU)
    cuda_job zmq    (any world size, ranks may share one GPU: staged through pinned memory)
"""
from __future__ import annotations

import os
import sys

import torch

import commrt


def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if not torch.equal(got.cpu(), want):
        raise AssertionError(f"{name}: CUDA result differs from the CPU reference")
    print(f"OK {name}", flush=True)


def main() -> int:
    backend = sys.argv[1]
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local % torch.cuda.device_count())
    commrt.init_process_group(backend=backend)
    assert commrt.get_backend() == backend, commrt.get_backend()
    rank, world = commrt.get_rank(), commrt.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    for numel in (7, 1000, 3 << 20):  # the last one is staged in several pieces on zmq
        parts = [torch.arange(numel, dtype=torch.float32) % 13 + r for r in range(world)]
        t = parts[rank].to(dev)
        commrt.all_reduce(t)
        check(f"all_reduce {numel}", t, sum(parts))
        w = commrt.all_reduce(parts[rank].to(dev), async_op=True)
        w.wait()
    b = (torch.arange(10.0) + rank).to(dev)
    commrt.broadcast(b, src=0)
    check("broadcast", b, torch.arange(10.0))
    inp = torch.arange(4.0 * world).to(dev) + rank
    out = torch.empty(4, device=dev)
    commrt.reduce_scatter_tensor(out, inp)
    check("reduce_scatter", out, sum(torch.arange(4.0 * world) + r for r in range(world))[rank * 4:rank * 4 + 4])
    gathered = torch.empty(3 * world, device=dev)
    commrt.all_gather_into_tensor(gathered, torch.full((3,), float(rank), device=dev))
    check("all_gather", gathered, torch.arange(world).repeat_interleave(3).float())
    if backend == "zmq":  # an integer AVG sums in 64 bits (backends.base.widened): 100 x 2 wrapped in int8
        t = torch.full((5,), 100, dtype=torch.int8, device=dev)
        commrt.all_reduce(t, op="avg")
        check("int8 avg", t, torch.full((5,), 100, dtype=torch.int8))
    if world > 1 and backend == "zmq":
        if rank == 0:
            commrt.send(torch.arange(5.0, device=dev), dst=1)
        elif rank == 1:
            got = torch.empty(5, device=dev)
            commrt.recv(got, src=0)
            check("send/recv", got, torch.arange(5.0))
    commrt.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
