"""Edge cases of DataParallel and the ZeRO engine found by the training review, each against
single-process torch on the global batch (zero_job's data and comparison). One case per run:
``python -m tests.multirank.programs.train_edges <case>``; each prints 'OK <what>' or raises.
"""
from __future__ import annotations

import sys

import torch
from torch import nn

import commrt
from commrt.train import DataParallel
from tests.multirank.programs.zero_job import compare, data


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


CASES = {"ddp_no_sync": ddp_no_sync_case}


def main() -> int:
    torch.set_num_threads(1)
    commrt.init_process_group()
    CASES[sys.argv[1]](commrt.get_rank(), commrt.get_world_size())
    commrt.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
