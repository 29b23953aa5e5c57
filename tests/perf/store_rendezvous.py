"""What rank 0's store serves in a rendezvous at n ranks (issue 32 item 5), on this host.

    flock -x /tmp/w/cpu.lock python -m tests.perf.store_rendezvous 256 1024 4096 16384

Every rank's rendezvous ends with one request for every hello (runtime/rendezvous.gather: an
mget of n keys of ~210 B). One store, one client, loopback: n hellos are set, then the median of
5 such requests is timed; n ranks make n of them, all served by rank 0's one store thread, so
the last column (n x one request) is the serial work that grows as n^2. A 27-key request is what a
rank would fetch if it read only the hellos of the peers it dials (log2 n + a few at 16,384).
"""
from __future__ import annotations

import statistics
import sys
import time

from commrt.launch import free_port
from commrt.runtime.config import load_config
from commrt.runtime.store import StoreClient, StoreServer
from commrt.transport.transport import Transport

HELLO = b"h" * 210


def _median_s(client: StoreClient, keys: list[str], reps: int = 5) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        got = client.mget(keys)
        times.append(time.perf_counter() - start)
        assert got == [HELLO] * len(keys), "the store returned other bytes than were set"
    return statistics.median(times)


def main(worlds: list[int]) -> None:
    cfg = load_config(overrides={"security": {"mode": "none"}, "comm": {"timeout_s": 60}}, environ={})
    transport = Transport(cfg, "rank0")
    port = free_port()
    server = StoreServer(transport, "127.0.0.1", port)
    client = StoreClient(transport, "127.0.0.1", port, 60)
    print("| ranks | one rank's mget of every hello, ms | n x that: one store thread, s | bytes served, GB | 27-key mget, ms |")
    print("|---:|---:|---:|---:|---:|")
    try:
        for n in worlds:
            keys = [f"n{n}/hello/{r}/1" for r in range(n)]
            for k in keys:
                client.set(k, HELLO)
            every, few = _median_s(client, keys), _median_s(client, keys[:27])
            print(f"| {n} | {every * 1e3:.2f} | {every * n:.1f} | {n * n * len(HELLO) / 1e9:.3f} | {few * 1e3:.3f} |",
                  flush=True)
    finally:
        client.close()
        server.close()
        transport.close()


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [256, 1024, 4096, 16384])
