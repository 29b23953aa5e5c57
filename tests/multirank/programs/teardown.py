"""Teardown, liveness and progress of one group, on real ranks. Each mode prints what every rank
saw ('CAUGHT <type>: <message>', 'RESULT ...') for tests/multirank/test_teardown.py to check.

    teardown MODE DIR   DIR: a scratch folder the ranks signal each other through (files)
"""
from __future__ import annotations

import os
import resource
import sys
import threading
import time

import numpy as np
import zmq

import commrt
from commrt.transport.wire import COLL, P2P, Header, encode_header

RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
WAIT_S = 60.0  # how long a rank waits for another's signal file before giving up


def signal(folder: str, name: str) -> None:
    with open(os.path.join(folder, name), "w") as fh:
        fh.write("1")


def wait_signal(folder: str, name: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not os.path.exists(os.path.join(folder, name)):
        if time.monotonic() > deadline:
            raise SystemExit(f"rank {RANK}: no '{name}' signal within {WAIT_S}s")
        time.sleep(0.01)


def _coll_socket(dst: int):
    """The world group's collective socket to ``dst`` (a test reaching under the API to forge)."""
    ep = commrt.distributed._rt().world.backend._coll
    return ep.socket_to(dst) if hasattr(ep, "socket_to") else ep._out[dst]


def inflight(folder: str) -> None:
    """destroy_process_group() while an async op is blocked in a receive: rank 1 never joins."""
    if RANK == 1:
        wait_signal(folder, "destroyed")
        commrt.destroy_process_group()
        return
    work = commrt.all_reduce(np.ones(1 << 20, np.float32), async_op=True)
    try:
        work.wait(timeout=0.5)
        print("NOT CAUGHT: the all_reduce completed without rank 1", flush=True)
    except commrt.CommError as exc:
        print(f"WAIT GAVE UP {type(exc).__name__}", flush=True)
    finally:
        commrt.destroy_process_group()
        signal(folder, "destroyed")
    work.wait(timeout=WAIT_S)  # must raise the typed error, not hang or crash


def torchwork(folder: str) -> None:
    """gloo: is_completed() polling ends (AVG finished); an expired wait(timeout) is retryable."""
    t = np.full(1000, float(RANK + 1), np.float32)
    work = commrt.all_reduce(t, op=commrt.ReduceOp.AVG, async_op=True)
    deadline = time.monotonic() + WAIT_S
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise SystemExit("is_completed() never became True")
        time.sleep(0.001)
    want = sum(range(1, WORLD + 1)) / WORLD
    assert np.all(t == want), (t[:4], want)
    if RANK == 1:
        wait_signal(folder, "expired")
    u = np.full(10, float(RANK + 1), np.float32)
    work = commrt.all_reduce(u, async_op=True)
    if RANK == 0:
        try:
            work.wait(timeout=0.2)
            raise SystemExit("wait(0.2) returned although rank 1 had not joined")
        except commrt.CommError as exc:
            print(f"EXPIRED {type(exc).__name__}", flush=True)
        signal(folder, "expired")
    work.wait(timeout=WAIT_S)
    assert np.all(u == sum(range(1, WORLD + 1))), u[:4]
    print(f"RESULT rank {RANK} ok", flush=True)


def mismatch3(folder: str) -> None:
    """Rank 1 runs float64, the others float32 (a ring-sized tensor)."""
    dtype = np.float64 if RANK == 1 else np.float32
    commrt.all_reduce(np.ones(1 << 18, dtype))


def queue(folder: str) -> None:
    """Hundreds of async all_reduces queued, then a sync one: queueing is not a peer's silence."""
    ops, timeout = int(os.environ.get("QUEUE_OPS", "600")), float(os.environ["COMMRT_COMM_TIMEOUT_S"])
    t = np.full(1 << 19, float(RANK), np.float32)
    if RANK == 1:
        time.sleep(timeout / 2)  # one rank late: still within the deadline of a peer's silence
    started = time.monotonic()
    works = [commrt.all_reduce(t, op=commrt.ReduceOp.MAX, async_op=True) for _ in range(ops)]
    last = np.full(4, float(RANK), np.float32)
    commrt.all_reduce(last)
    print(f"QUEUE DRAINED in {time.monotonic() - started:.2f}s (timeout {timeout:g}s)", flush=True)
    for w in works:
        w.wait(timeout=WAIT_S)
    assert np.all(t == WORLD - 1) and np.all(last == sum(range(WORLD))), (t[:4], last)
    print(f"RESULT rank {RANK} ok", flush=True)


def flood(folder: str) -> None:
    """Rank 1 floods rank 0 with well-formed messages for a far-future op while rank 0 waits on
    rank 2 (which waits for the flood to end). Rank 0 must refuse before its memory balloons."""
    if RANK == 1:
        sock, junk = _coll_socket(0), bytes(1 << 20)
        head = encode_header(Header(COLL, 0, 10**6, 1, 1, 1, 1 << 18, 0, len(junk)))
        try:
            for _ in range(600):  # 600 MiB, unless rank 0 stops reading
                sock.send_multipart([head, junk])
        except zmq.ZMQError:  # rank 0 stopped reading (it refused the flood): enough
            pass
        wait_signal(folder, "flooded")
        return
    if RANK == 2:
        wait_signal(folder, "flooded")
        return
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        commrt.barrier()
    finally:
        grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) >> 10
        print(f"RSS GREW {grew} MiB", flush=True)
        signal(folder, "flooded")
    raise SystemExit("the barrier completed")


def _after_error(exc: BaseException) -> None:
    """The group must now refuse work with a clear error instead of misbehaving."""
    try:
        commrt.all_reduce(np.ones(3, np.float32))
        print("AFTER: the group still ran an all_reduce", flush=True)
    except commrt.CommError as nxt:
        print(f"AFTER {type(nxt).__name__}: {nxt}", flush=True)


def busy(folder: str) -> None:
    """Rank 0 waits on rank 2 (alive, silent) in a ring all_reduce while rank 1 keeps sending it
    small messages for another channel, faster than a receive slice: the wait must still end
    at its deadline, blaming rank 2, not live on as long as some peer is talkative."""
    if RANK == 1:
        sock = _coll_socket(0)
        chatter = encode_header(Header(P2P, 0, 1, 1, 7, 1, 0, 0, 0))  # tag 7, nobody asks for it
        while not os.path.exists(os.path.join(folder, "done")):
            sock.send_multipart([chatter, b""])
            time.sleep(0.01)
        return
    if RANK == 2:
        wait_signal(folder, "done")
        return
    try:
        commrt.all_reduce(np.ones(4 << 20, np.float32))
    finally:
        signal(folder, "done")


def p2p(folder: str) -> None:
    """irecv then isend on both sides (4 tags, from 2 threads) with one group-wide owner thread;
    sends complete while the caller does not call wait()."""
    peer = 1 - RANK
    numels = {0: 3, 1: 5 << 20, 2: 0, 3: 700_000}

    def exchange(tags) -> None:
        got = {tag: np.zeros(numels[tag], np.float32) for tag in tags}
        recvs = [commrt.irecv(got[tag], peer, tag=tag) for tag in tags]
        sends = [commrt.isend(np.full(numels[tag], float(RANK * 10 + tag), np.float32), peer, tag=tag) for tag in tags]
        deadline = time.monotonic() + WAIT_S
        while not all(w.is_completed() for w in sends + recvs):  # progress without wait()
            assert time.monotonic() < deadline, "p2p made no progress without wait()"
            time.sleep(0.001)
        for w in sends + recvs:
            w.wait(timeout=WAIT_S)
        for tag in tags:
            assert np.all(got[tag] == peer * 10 + tag), (tag, got[tag][:4])
    threads = [threading.Thread(target=exchange, args=(tags,)) for tags in ([0, 1], [2, 3])]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    owners = [th.name for th in threading.enumerate() if "send" in th.name or "recv" in th.name
              or "p2p" in th.name]
    print(f"P2P THREADS {len(owners)} {owners}", flush=True)
    print(f"RESULT rank {RANK} ok", flush=True)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def scale(folder: str) -> None:
    """Rendezvous, barrier and a small all_reduce; report this rank's open files and memory."""
    commrt.barrier()
    after_barrier = _fds()
    t = np.full(256, float(RANK), np.float32)
    commrt.all_reduce(t)
    assert np.all(t == sum(range(WORLD))), t[:4]
    with open("/proc/self/status") as fh:
        rss = next(int(line.split()[1]) for line in fh if line.startswith("VmRSS"))
    dialled = sorted(commrt.distributed._rt().world.backend._coll._out)  # peers with a connection
    print(f"SCALE rank {RANK} world {WORLD} fds {after_barrier} {_fds()} rss_kib {rss} "
          f"dialled {','.join(map(str, dialled))}", flush=True)


MODES = {f.__name__: f for f in (inflight, torchwork, mismatch3, queue, flood, busy, p2p, scale)}

if __name__ == "__main__":
    mode, folder = sys.argv[1], sys.argv[2]
    try:
        commrt.init_process_group()
        MODES[mode](folder)
        if commrt.is_initialized():
            commrt.destroy_process_group()
    except commrt.CommError as exc:
        print(f"CAUGHT {type(exc).__name__}: {exc}", flush=True)
        if mode in ("flood", "busy"):
            _after_error(exc)
        sys.exit(0)
