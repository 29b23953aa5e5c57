"""What one large point-to-point message costs the sending and the receiving main thread, in the
pattern the pipeline runtime uses (issue 29): the receiver posts every receive of a step at its
exact size first, then both ranks compute, and the sender posts one message after each
computation (isend, no wait), so the message lands while the receiver computes. Starts its 2 ranks:

    python -m tests.perf.p2p_send_cost --kib 1024 --messages 48 --compute-ms 5 --rounds 3

Per message, on the sender's main thread: the wall and CPU time of ``isend`` (``thread_time``:
what it ran itself; the rest is waiting for the core, a lock or the GIL), and with ``--detail``
the share of the ring copy, ZeroMQ's sends and the engine lock (timers wrapped around them).
On the receiver: the main thread's time in ``is_completed`` (which lands what has arrived, the
pipeline's ``pump``) and in ``wait``. A memcpy of the same size, timed alone, is printed beside.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import threading
import time

import torch

import commrt
from commrt.transport import p2p, p2p_send, shm_p2p

MAIN = threading.main_thread().ident
STATS: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])  # wall, cpu, count


def timed(name: str, fn):
    def wrapper(*a, **k):
        if threading.get_ident() != MAIN:
            return fn(*a, **k)
        w, c = time.perf_counter(), time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            s = STATS[name]
            s[0] += time.perf_counter() - w
            s[1] += time.thread_time() - c
            s[2] += 1
    return wrapper


def instrument() -> None:
    """Timers around the send path's pieces (main thread only)."""
    import zmq
    shm_p2p.OutRing.write = timed("ring write (memcpy)", shm_p2p.OutRing.write)
    zmq.Socket.send = timed("zmq send", zmq.Socket.send)
    p2p_send.Sender.post = timed("Sender.post (under the lock)", p2p_send.Sender.post)
    p2p.P2PEngine.post = timed("P2PEngine.post", p2p.P2PEngine.post)
    p2p.P2PEngine.test = timed("engine.test (lands arrivals)", p2p.P2PEngine.test)
    p2p.P2PEngine._deliver = timed("_deliver (landing copy)", p2p.P2PEngine._deliver)


def compute(ms: float, a: torch.Tensor) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        a @ a


def one_round(rank: int, compute_ms: float, a, bufs, out, hdr: bool) -> None:
    hdr_buf = torch.zeros(256)  # a 1 KiB header message before each payload, as pipeline/p2p.py's
    if rank == 1:
        heads = [commrt.irecv(torch.empty(256), 0, tag=4) for _ in bufs] if hdr else []
        works = [commrt.irecv(b, 0, tag=3) for b in bufs]
        commrt.barrier()
        for i, w in enumerate(works):
            compute(compute_ms, a)
            w0, c0 = time.perf_counter(), time.thread_time()
            w.is_completed()
            if hdr:
                heads[i].wait()
            out["pump"][0] += time.perf_counter() - w0
            out["pump"][1] += time.thread_time() - c0
            w0, c0 = time.perf_counter(), time.thread_time()
            w.wait()
            out["wait"][0] += time.perf_counter() - w0
            out["wait"][1] += time.thread_time() - c0
        return
    commrt.barrier()
    handles = []
    for b in bufs:
        compute(compute_ms, a)
        w0, c0 = time.perf_counter(), time.thread_time()
        if hdr:
            handles.append(commrt.isend(hdr_buf, 1, tag=4))
        handles.append(commrt.isend(b, 1, tag=3))
        out["isend"][0] += time.perf_counter() - w0
        out["isend"][1] += time.thread_time() - c0
    for h in handles:
        h.wait()


def latency(rank: int, compute_ms: float, a, bufs, prepost: bool) -> list[float]:
    """Rank 1 waits for each message while rank 0 computes, then sends it (a pipeline's critical
    path): microseconds from rank 0's isend to rank 1's wait returning (one host, one clock)."""
    out = []
    if rank == 1:
        works = [commrt.irecv(b, 0, tag=5) for b in bufs] if prepost else None
        commrt.barrier()
        for i, b in enumerate(bufs):
            (works[i] if prepost else commrt.irecv(b, 0, tag=5)).wait()
            out.append((time.perf_counter() - float(b.view(torch.float64)[0])) * 1e6)
        return out
    commrt.barrier()
    handles = []
    for b in bufs:
        compute(compute_ms, a)
        b.view(torch.float64)[0] = time.perf_counter()
        handles.append(commrt.isend(b, 1, tag=5))
    for h in handles:
        h.wait()
    return out


def main_rank(args) -> None:
    torch.set_num_threads(1)
    if args.detail:
        instrument()
    commrt.init_process_group()
    rank = commrt.get_rank()
    n = args.kib * 1024
    a = torch.randn(64, 64)
    src = torch.arange(n // 4, dtype=torch.float32)
    bufs = [src.clone() + i if rank == 0 else torch.empty(n // 4) for i in range(args.messages)]
    out = collections.defaultdict(lambda: [0.0, 0.0])
    if args.latency:
        for prepost in (True, False, True, False):
            lat = sorted(latency(rank, args.compute_ms, a, bufs, prepost))
            if rank == 1:
                print(f"rank 1: {args.kib} KiB, receive {'posted ahead' if prepost else 'posted at the wait'}: "
                      f"latency median {lat[len(lat) // 2]:.0f} us, p90 {lat[len(lat) * 9 // 10]:.0f} us", flush=True)
        commrt.barrier()
        commrt.destroy_process_group()
        return
    one_round(rank, args.compute_ms, a, bufs, out, args.header)  # warm-up: rings mapped, pages touched
    if rank == 1:
        bad = sum(int(not torch.equal(b, src + i)) for i, b in enumerate(bufs))
        assert bad == 0, f"{bad} messages differ from what was sent"
    out.clear()
    STATS.clear()
    for _ in range(args.rounds):
        one_round(rank, args.compute_ms, a, bufs, out, args.header)
    per = args.rounds * args.messages
    line = ", ".join(f"{k} {v[0] / per * 1e6:.0f} us wall / {v[1] / per * 1e6:.0f} us cpu" for k, v in out.items())
    print(f"rank {rank}: {args.kib} KiB, per message: {line}", flush=True)
    for name, (w, c, cnt) in sorted(STATS.items()):
        print(f"rank {rank}:   {name}: {cnt / per:.1f} calls/msg, {w / per * 1e6:.0f} us wall / "
              f"{c / per * 1e6:.0f} us cpu per msg", flush=True)
    if rank == 0:
        x, y = torch.empty(n, dtype=torch.uint8), torch.ones(n, dtype=torch.uint8)
        x.copy_(y)
        t0 = time.perf_counter()
        for _ in range(50):
            x.copy_(y)
        print(f"rank 0: a {args.kib} KiB memcpy alone: {(time.perf_counter() - t0) / 50 * 1e6:.0f} us", flush=True)
    commrt.barrier()
    commrt.destroy_process_group()


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kib", type=int, default=1024)
    p.add_argument("--messages", type=int, default=48)
    p.add_argument("--compute-ms", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--detail", action="store_true")
    p.add_argument("--latency", action="store_true", help="isend-to-wait latency, receive posted ahead or not")
    p.add_argument("--header", action="store_true", help="a 1 KiB message before each (the split path)")
    args = p.parse_args(argv)
    if "RANK" not in os.environ:
        from commrt.launch import launch
        return launch(2, [sys.executable, "-m", "tests.perf.p2p_send_cost", *argv], prefix=False).returncode
    main_rank(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
