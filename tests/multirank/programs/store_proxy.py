"""A store per node (issue 32.5): run as several nodes on this host (the launcher's node
variables), numpy buffers only. Every rank checks its results exactly against the
single-process arithmetic and how it reaches the store (comm_stats()["rendezvous"]).

    ops          barrier, all_reduce, new_group and its all_reduce, shutdown; rank 0 prints how
                 many store connections it served, each node's leader how many ranks its proxy did
    leader_dies  node 1's leader is killed after init: node 1's other rank's parked wait and its
                 next call fail with a RendezvousError naming the proxy within about a heartbeat
                 interval; node 2's go on
    proxy_mismatch  rank 3's [cluster] store_proxy differs from its leader's (and everyone's):
                 every rank fails init with the config digest error naming rank 3
"""
from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np

import commrt
from commrt.runtime import store_proxy
from commrt.runtime.errors import RendezvousError

RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
PER_NODE, NODE = int(os.environ["LOCAL_WORLD_SIZE"]), int(os.environ["GROUP_RANK"])
LOCAL = int(os.environ["LOCAL_RANK"])


def _check_store_stats() -> dict:
    got = commrt.comm_stats()["rendezvous"]
    proxied = os.environ.get("COMMRT_CLUSTER_STORE_PROXY", "true") != "false"
    assert got["store_via_proxy"] == (proxied and NODE != 0), f"rank {RANK}: {got}"
    return got


def ops() -> None:
    commrt.init_process_group()
    got = _check_store_stats()
    commrt.barrier()
    x = np.arange(1024, dtype=np.int64) * (RANK + 1)
    commrt.all_reduce(x)
    assert np.array_equal(x, np.arange(1024, dtype=np.int64) * (WORLD * (WORLD + 1) // 2)), f"rank {RANK}"
    evens = list(range(0, WORLD, 2))
    g = commrt.new_group(evens)
    if RANK in evens:
        y = np.full(8, RANK + 1, np.float64)
        commrt.all_reduce(y, group=g)
        assert y.tolist() == [float(sum(r + 1 for r in evens))] * 8, f"rank {RANK}: new_group all_reduce"
    commrt.barrier()
    got = _check_store_stats()
    if RANK == 0:
        print(f"STORE rank 0 served {got['store_connections']} connections", flush=True)
    if got["proxy_clients"] is not None:
        print(f"PROXY node {NODE} rank {RANK} served {got['proxy_clients']} ranks", flush=True)
    print(f"OK rank {RANK}", flush=True)
    commrt.destroy_process_group()


def _probe(what: str, call) -> None:
    start = time.monotonic()
    try:
        call()
        print(f"PROBE rank {RANK} {what} ok", flush=True)
    except RendezvousError as exc:
        print(f"PROBE rank {RANK} {what} failed after {time.monotonic() - start:.1f}s: {exc}", flush=True)


def leader_dies() -> None:
    commrt.init_process_group()
    commrt.barrier()
    rt = commrt.distributed._rt()
    rt.store.timeout_s = 5.0  # the calls' own deadline (init ran under the job's longer one)
    if NODE == 1 and LOCAL == 0:
        time.sleep(0.3)  # its node's other rank parks a wait first (or calls after the death: as prompt)
        os.kill(os.getpid(), signal.SIGKILL)
    if NODE == 1:  # a wait parked through the proxy when its leader dies, then a call made after
        _probe("wait", lambda: rt.store.wait(["never"], None, 20.0))
        _probe("add", lambda: rt.store.add("probe", 1))
    elif NODE == 2 and LOCAL == 1:
        _probe("add", lambda: rt.store.add("probe", 1))
    else:  # rank 0 serves the store, rank 4 node 2's proxy, until rank 5's probe is answered
        rt.store.wait_count("probe", 1, None, 20.0)
        # rank 4's proxy passes rank 5's answer on; rank 0 outlives node 1's leader, so that
        # rank 3 sees its proxy go, not the store behind it
        time.sleep(2.0 if RANK == 0 else 0.5)
    os._exit(0)  # a world with a dead rank: no orderly shutdown to test here


def proxy_mismatch() -> None:
    """Rank 3 runs with [cluster] store_proxy = true, the rest (its leader too) with false."""
    store_proxy.ABSENT_S = 1.0  # the wait for a proxy before dialling the store (10 s): kept short
    if RANK == 3:
        os.environ["COMMRT_CLUSTER_STORE_PROXY"] = "true"
    try:
        commrt.init_process_group()
    except RendezvousError as exc:
        print(f"CAUGHT RendezvousError: {exc}", flush=True)
        return
    raise AssertionError(f"rank {RANK}: init succeeded with rank 3's store_proxy unlike the others'")


if __name__ == "__main__":
    {"ops": ops, "leader_dies": leader_dies, "proxy_mismatch": proxy_mismatch}[sys.argv[1]]()
