"""A small job for the multi-host tests: prints the addresses this rank advertised and the TCP
sockets this process listens on, then checks all_reduce, broadcast and all_gather against the
single-process reference.

    multihost
"""
from __future__ import annotations

import os

import numpy as np

import commrt
from commrt import distributed
from tests.multirank.programs.np_ref import reference, values


def listening() -> list[str]:
    """'ip:port' of every TCP socket this process listens on (from /proc, no tools needed)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found = []
    for table, width in (("/proc/self/net/tcp", 8), ("/proc/self/net/tcp6", 32)):
        with open(table) as fh:
            for line in fh.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # state LISTEN, one of ours
                    found.append(_addr(cols[1], width))
    return sorted(found)


def _addr(field: str, width: int) -> str:
    host, port = field.split(":")
    raw = bytes.fromhex(host)
    if width == 8:
        ip = ".".join(str(b) for b in raw[::-1])
    else:
        words = [raw[i:i + 4][::-1] for i in range(0, 16, 4)]
        ip = "[" + b"".join(words).hex() + "]"
    return f"{ip}:{int(port, 16)}"


def main() -> None:
    commrt.init_process_group()
    rank, n = commrt.get_rank(), commrt.get_world_size()
    backend = distributed._rt().world.backend  # noqa: SLF001 - the test inspects what was advertised
    print(f"rank {rank}: ADVERTISED {getattr(backend, 'addresses', [])}", flush=True)
    print(f"rank {rank}: LISTENING {' '.join(listening())}", flush=True)
    for seed, numel in enumerate([1, 1003, 70001]):
        parts = [values(numel, r, np.float32, "SUM", seed) for r in range(n)]
        t = parts[rank].copy()
        commrt.all_reduce(t)
        assert np.array_equal(t, reference(parts, "SUM")), f"all_reduce n={numel}"
        t = values(numel, rank, np.int64, "SUM", seed)
        commrt.broadcast(t, src=n - 1)
        assert np.array_equal(t, values(numel, n - 1, np.int64, "SUM", seed)), f"broadcast n={numel}"
        out = np.zeros(numel * n, np.float32)
        commrt.all_gather_into_tensor(out, parts[rank])
        assert np.array_equal(out, np.concatenate(parts)), f"all_gather n={numel}"
    commrt.barrier()
    commrt.destroy_process_group()
    print(f"rank {rank}: multihost passed on {n} ranks", flush=True)


if __name__ == "__main__":
    main()
