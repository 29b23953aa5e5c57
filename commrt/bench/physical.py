"""The raw TCP ceiling of a ring on these hosts: every rank sends to its right neighbour and
receives from its left at the same time over plain sockets, as a ring step does. Per-link
GB/s from this is what busbw can at best reach (``--physical``).

For ranks that share a node through shared memory the link is memory itself: ``memory_ceiling``
measures this host's memcpy and reduction (a+b -> out) bandwidth, every rank at once, at the
size being benchmarked."""
from __future__ import annotations

import socket
import threading
import time

import numpy as np
import torch

from commrt.runtime import addresses
from commrt.collectives.reduce_ops import ReduceOp
from commrt.runtime.store import wait_for
from commrt.bench import metrics


class TcpRing:
    def __init__(self, out_sock: socket.socket | None, in_sock: socket.socket | None):
        self.out, self.inp = out_sock, in_sock

    @classmethod
    def open(cls, store, rank: int, n: int, host: str, timeout_s: float = 30.0,
             advertise: str | None = None) -> "TcpRing":
        """Listen on ``host``, publish ``advertise`` (default ``host``): the address peers dial,
        as the transport's ``advertise_host``) and the port, dial the right neighbour's. Each
        rank used to dial its own ``host`` with the neighbour's port: over two nodes, itself."""
        if n == 1:
            return cls(None, None)
        listener = socket.create_server((addresses.bare(host), 0), family=addresses.family(host))
        out = inp = None
        try:  # a neighbour that never publishes or never dials: nothing left open (the raise says which)
            listener.settimeout(timeout_s)
            store.set(f"tcp/addr/{rank}", f"{advertise or host}:{listener.getsockname()[1]}".encode())
            right = (rank + 1) % n
            where = bytes(wait_for(store, [f"tcp/addr/{right}"], timeout_s, "tcp ring")[0]).decode()
            addr, _, port = where.rpartition(":")
            out = socket.create_connection((addr, int(port)), timeout=timeout_s)
            inp, _ = listener.accept()
            for s in (out, inp):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                s.settimeout(timeout_s)
            return cls(out, inp)
        except BaseException:
            cls(out, inp).close()
            raise
        finally:
            listener.close()

    def measure(self, be, nbytes: int, iters: int, warmup: int) -> float:
        """Per-link GB/s of the slowest rank moving ``nbytes`` per iteration."""
        if self.out is None:
            return float("inf")
        send_buf, recv_buf = bytearray(nbytes), bytearray(nbytes)
        view = memoryview(recv_buf)

        def step(count: int) -> None:
            sender = threading.Thread(target=lambda: [self.out.sendall(send_buf) for _ in range(count)])
            sender.start()
            for _ in range(count):
                got = 0
                while got < nbytes:
                    k = self.inp.recv_into(view[got:], nbytes - got)
                    if k == 0:
                        raise ConnectionError("tcp ring peer closed")
                    got += k
            sender.join()
        step(warmup)
        be.barrier(False)
        start = time.perf_counter()
        step(iters)
        t = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        be.all_reduce(t, ReduceOp.MAX, False)
        return nbytes * iters / float(t[0]) / 1e9

    def close(self) -> None:
        for s in (self.out, self.inp):
            if s is not None:
                s.close()


def memory_ceiling(be, collective: str, nbytes: int, iters: int, warmup: int) -> dict:
    """memcpy and a+b -> out GB/s (bytes written per second) of the slowest rank, every rank
    running them at the same time (as the ranks of a node do in a shared-memory collective),
    and the busbw ceiling they give ``collective`` (metrics.shm_busbw_ceiling)."""
    count = max(1, nbytes // 4)
    a, b, out = (np.full(count, v, dtype=np.float32) for v in (1.0, 2.0, 0.0))  # touched: no faults
    kernels = {"memcpy": lambda: np.copyto(out, a), "reduce": lambda: np.add(a, b, out=out)}
    got = {}
    for name, kernel in kernels.items():
        for _ in range(warmup):
            kernel()
        be.barrier(False)
        start = time.perf_counter()
        for _ in range(iters):
            kernel()
        t = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        be.all_reduce(t, ReduceOp.MAX, False)
        got[name] = count * 4 * iters / float(t[0]) / 1e9
    got["busbw"] = metrics.shm_busbw_ceiling(collective, got["memcpy"], got["reduce"])
    return got
