"""Peers' hellos read when first dialled (issue 32.5): run with node hints for several nodes
(the launcher's ``Nodes``), numpy buffers only. Every rank checks its results exactly against
the single-process arithmetic and how many hellos it read from the store (comm_stats).

    ops       all_reduce, a receive from any source, all_to_all_single; prints HELLOS lines
    mismatch  rank 5 runs another config: every rank must fail naming rank 5 and rank 0, rank 6
              too, which arrives 2.5 s late (after the others have failed)
    late      rank 0 leaves right after init; rank 3 first dials rank 6 (another node; not a
              barrier partner) a second later: its hello must still be readable (rank 0 keeps its store until all leave)
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

import commrt
from commrt.runtime import bootstrap
from commrt.runtime.errors import RendezvousError

RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def _dialled() -> set[int]:
    backend = commrt.distributed._rt().world.backend
    return set(backend._coll._out) | set(backend._p2p_ep._out)  # peers with a connection


def _check_reads(expect: int, when: str) -> int:
    got = commrt.comm_stats()["rendezvous"]
    assert got["lazy"], got
    assert got["hellos_read"] == expect, f"rank {RANK} {when}: read {got['hellos_read']} hellos, expected {expect}"
    return got["hellos_read"]


def ops() -> None:
    commrt.init_process_group()
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    x = np.arange(512, dtype=np.int64) * (RANK + 1)  # 4 KiB
    commrt.all_reduce(x)
    assert np.array_equal(x, np.arange(512, dtype=np.int64) * (WORLD * (WORLD + 1) // 2)), f"rank {RANK}: all_reduce"
    node = RANK // per_node
    local = set(range(node * per_node, node * per_node + per_node)) - {RANK}
    # rank 0 read every hello (it checks the layout); the others rank 0's, this node's, the
    # likely partners read with them at init, and those they dialled besides: each once
    likely = bootstrap._likely_partners(RANK, WORLD)
    first = _check_reads(WORLD if RANK == 0 else len((local | _dialled() | likely | {0}) - {RANK}), "after all_reduce")
    if RANK != 0:
        assert first < WORLD - 1, f"rank {RANK} read {first} of {WORLD - 1} peers' hellos"
    if RANK == 1:  # a receive from any source dials every peer: the rest are read then, once
        buf = np.zeros(4, np.int64)
        assert commrt.recv(buf, None, tag=7) == WORLD - 1 and buf.tolist() == [WORLD - 1] * 4
        _check_reads(WORLD - 1, "after a receive from any source")
    elif RANK == WORLD - 1:
        commrt.send(np.full(4, WORLD - 1, np.int64), 1, tag=7)
    inp = np.array([RANK * 1000 + j for j in range(WORLD) for _ in range(3)], np.int64)
    out = np.zeros_like(inp)
    commrt.all_to_all_single(out, inp)  # talks to every peer: every hello read, each once
    assert out.tolist() == [j * 1000 + RANK for j in range(WORLD) for _ in range(3)], f"rank {RANK}: all_to_all"
    _check_reads(WORLD if RANK == 0 else WORLD - 1, "after all_to_all")
    print(f"HELLOS rank {RANK} world {WORLD} read {first} then {WORLD - 1} ok", flush=True)
    commrt.destroy_process_group()


def mismatch() -> None:
    if RANK == 5:
        os.environ["COMMRT_COMM_CHUNK_BYTES"] = str(1 << 19)
    if RANK == 6:  # slow to arrive (a loaded machine): rank 0's store and rank 4's proxy must still answer
        time.sleep(2.5)
    try:
        commrt.init_process_group()
    except RendezvousError as exc:
        print(f"CAUGHT RendezvousError: {exc}", flush=True)
        return
    raise AssertionError(f"rank {RANK}: init succeeded with a mismatched config on rank 5")


def late() -> None:
    commrt.init_process_group()
    if RANK == 3:
        time.sleep(1.0)
        commrt.send(np.full(4, 3, np.int64), 6)
    elif RANK == 6:
        buf = np.zeros(4, np.int64)
        commrt.recv(buf, 3)
        assert buf.tolist() == [3] * 4, buf
        print("LATE rank 6 got rank 3's message", flush=True)
    commrt.destroy_process_group()


if __name__ == "__main__":
    {"ops": ops, "mismatch": mismatch, "late": late}[sys.argv[1]]()
