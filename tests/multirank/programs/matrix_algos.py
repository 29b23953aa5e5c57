"""The collective matrix (matrix.py: every dtype, op and odd size against the single-process
reference) with the schedules pinned by COMMRT_COMM_ALGORITHMS (the test runs each pin in turn),
plus a check that the pinned all_reduce really ran: the messages one small all_reduce sends,
counted by comm_stats(), must be what its schedule says."""
from __future__ import annotations

import os

import torch

import commrt
from commrt.collectives.schedules import messages_sent, schedule
from commrt.runtime.config.comm import parse_algorithms
from tests.multirank.programs import common, matrix


def all_reduce_messages() -> int:
    before = commrt.comm_stats()["by_op"].get("all_reduce", {}).get("messages", 0)
    commrt.all_reduce(torch.ones(5, dtype=torch.int32))
    return commrt.comm_stats()["by_op"]["all_reduce"]["messages"] - before


def check_pinned_all_reduce_ran() -> None:
    rank, n = commrt.get_rank(), commrt.get_world_size()
    pinned = parse_algorithms(os.environ.get("COMMRT_COMM_ALGORITHMS", "")).get("all_reduce")
    if n == 1 or not pinned:
        return
    want = messages_sent(schedule("all_reduce", pinned[0]["algorithm"], n).ranks[rank])
    got = all_reduce_messages()
    assert got == want, f"rank {rank}: a 5-element all_reduce sent {got} messages, {pinned[0]} sends {want}"


def init_and_check() -> tuple[int, int]:
    rank, n = common.init()
    check_pinned_all_reduce_ran()
    return rank, n


matrix.init = init_and_check  # matrix.main() runs the check first, in its own process group

if __name__ == "__main__":
    matrix.main()
