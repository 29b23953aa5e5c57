"""Point-to-point transfers between ranks of one node, each against what was sent.

    shm_p2p MODE   with MODE in
      data   rank 0 sends every size, dtype and tag to every peer; tags out of order; more
             in flight than a ring holds, sent before the receiver posts; replies back
      kill   rank 1 sends one large message (its ring to rank 0 exists), then is SIGKILLed;
             rank 0's next recv from it is a PeerLost naming rank 1
      mixed  small and large messages, at once or late, in bursts, on two tags: through the
             mailbox, the socket and the ring, in order (transport/mailbox.py)
      unreceived  rank 1 puts a large message in its ring that rank 0 never receives, then is
             SIGKILLed
      groups  groups made and destroyed, with and without a transfer: each leaves no shared
             memory open or mapped in this process
Every rank prints its pid, each ring when first used, and whether transfers went through rings."""
from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np

import commrt
from commrt.transport import shm_p2p

SIZES = [0, 1, 7, (32 << 10) // 4 - 1, (32 << 10) // 4 + 3, shm_p2p.RING_BYTES // 8 + 5, (3 << 20) + 1]


def _announce_rings() -> None:
    """Print each ring when a payload first goes into it (every pair's ring exists from setup)."""
    reserve = shm_p2p.OutRing.reserve_memory

    def reserve_memory(self):
        reserve(self)
        print(f"ring: {self.name}", flush=True)
    shm_p2p.OutRing.reserve_memory = reserve_memory


def expected(size: int, dtype, dst: int, tag: int):
    """What ``dst`` receives on ``tag``: float32 on numpy, or a torch tensor of ``dtype``."""
    values = (np.arange(size) * (dst + 3) + tag) % 113
    if dtype is np.float32:
        return values.astype(np.float32)
    import torch  # data: torch's dtypes (bfloat16 has no numpy one)
    return torch.from_numpy(values).to(dtype)


def data(rank: int, n: int) -> None:
    import torch  # the one mode on torch tensors; the others run on numpy, without torch's import
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for tag, size in enumerate(SIZES):
            if rank == 0:
                works = [commrt.isend(expected(size, dtype, p, tag), p, tag=tag) for p in range(1, n)]
                for w in works:
                    w.wait()
            else:
                out = torch.full((size,), -1, dtype=dtype)
                commrt.recv(out, 0, tag=tag)
                assert torch.equal(out, expected(size, dtype, rank, tag)), (dtype, size, tag)
    big = [expected(3 << 18, torch.float32, 1, t) for t in (1, 2)]
    if rank == 0:  # tag 1 then tag 2; rank 1 takes tag 2 first
        for w in [commrt.isend(big[0], 1, tag=1), commrt.isend(big[1], 1, tag=2)]:
            w.wait()
    elif rank == 1:
        got = [torch.empty_like(b) for b in big]
        commrt.recv(got[1], 0, tag=2)
        commrt.recv(got[0], 0, tag=1)
        assert all(torch.equal(g, b) for g, b in zip(got, big))
    count = shm_p2p.RING_BYTES // (1 << 20) + 2  # 1 MiB each: more than the ring holds
    if rank == 0:  # every isend completes before rank 1 posts a receive (it waits for our word)
        works = [commrt.isend(torch.full((1 << 18,), float(i)), 1, tag=9) for i in range(count)]
        for w in works:
            w.wait()
        commrt.send(torch.ones(1), 1, tag=10)
    elif rank == 1:
        commrt.recv(torch.empty(1), 0, tag=10)
        for i in range(count):
            got = torch.empty(1 << 18)
            commrt.recv(got, 0, tag=9)
            assert bool((got == i).all()), i
    if rank:  # and back: every rank sends to rank 0 at once
        commrt.send(expected(1 << 18, torch.float32, rank, 5), 0, tag=5)
    else:
        for p in range(1, n):
            got = torch.empty(1 << 18)
            commrt.recv(got, p, tag=5)
            assert torch.equal(got, expected(1 << 18, torch.float32, p, 5)), p


def mixed(rank: int, n: int) -> None:
    """Rank 0 sends rank 1 small and large messages on two tags, at once or after rank 1 has
    stopped spinning (so some go through its mailbox, some over the socket, some as ring
    descriptors), singly and in bursts; rank 1 takes each tag in order and answers each round."""
    sizes = [1, 1024, 7, 10 << 10, 0, 100 << 10, 33, 3000]
    for rnd in range(120):
        plan = [(t, sizes[(rnd + i) % len(sizes)]) for i, t in enumerate((1, 2, 1, 1, 2)[:1 + rnd % 5])]
        if rank == 0:
            if rnd % 3 == 1:
                time.sleep(0.002)  # rank 1 has blocked on its socket by now
            works = [commrt.isend(expected(s, np.float32, rnd, t), 1, tag=t) for t, s in plan]
            for w in works:
                w.wait()
            back = np.empty(1024, np.float32)
            commrt.recv(back, 1, tag=3)
            assert np.array_equal(back, expected(1024, np.float32, rnd, 3)), rnd
        elif rank == 1:
            for tag in (2, 1):  # tag 2 first: tag 1's messages wait, matched later in order
                for t, s in plan:
                    if t == tag:
                        got = np.full(s, -1.0, np.float32)
                        commrt.recv(got, 0, tag=t)
                        assert np.array_equal(got, expected(s, np.float32, rnd, t)), (rnd, t, s)
            commrt.send(expected(1024, np.float32, rnd, 3), 0, tag=3)


def sent_sizes(rank: int, n: int) -> list[int]:
    """The bytes of each send ``data`` makes this rank issue, in order."""
    import torch
    if rank:
        return [(1 << 18) * 4]
    per_peer = [expected(s, d, 0, 0).numel() * expected(s, d, 0, 0).element_size()
                for d in (torch.float32, torch.bfloat16, torch.int64) for s in SIZES]
    count = shm_p2p.RING_BYTES // (1 << 20) + 2
    return per_peer * (n - 1) + [(3 << 18) * 4] * 2 + [(1 << 18) * 4] * count + [4]


def kill(rank: int, n: int) -> None:
    if rank == 1:
        commrt.send(expected(1 << 20, np.float32, 0, 1), 0, tag=1)
        commrt.recv(np.empty(1, np.float32), 0, tag=2)  # rank 0 has it: now die with our ring mapped on both sides
        os.kill(os.getpid(), signal.SIGKILL)
    elif rank == 0:
        got = np.empty(1 << 20, np.float32)
        commrt.recv(got, 1, tag=1)
        assert np.array_equal(got, expected(1 << 20, np.float32, 0, 1))
        commrt.send(np.ones(1, np.float32), 1, tag=2)
        try:
            commrt.recv(got, 1, tag=3)
        except commrt.PeerLost as exc:
            print(f"CAUGHT PeerLost: {exc}", flush=True)


def unreceived(rank: int, n: int) -> None:
    """Rank 1 puts a large message in its ring to rank 0, which never receives it, and is
    SIGKILLed: no process ever unlinks or unmaps anything, and nothing may be left."""
    if rank == 1:
        commrt.isend(expected(1 << 20, np.float32, 0, 1), 0, tag=1).wait()  # complete: in the ring
        os.kill(os.getpid(), signal.SIGKILL)
    elif rank == 0:
        try:
            commrt.recv(np.empty(1, np.float32), 1, tag=3)
        except commrt.PeerLost as exc:
            print(f"CAUGHT PeerLost: {exc}", flush=True)


def _memfds() -> tuple[int, int]:
    """(descriptors, mappings) of anonymous memory files in this process: segments and rings."""
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
        except OSError:  # the listing's own descriptor, closed by now
            pass
    with open("/proc/self/maps") as f:
        return fds, sum("/memfd:" in line for line in f)


def groups(rank: int, n: int) -> None:
    commrt.barrier()
    before = _memfds()
    for i in range(3):
        group = commrt.new_group(list(range(n)))
        if i == 2:  # its point-to-point engine ran, and the rings carried a payload
            if rank == 0:
                commrt.send(np.ones(1 << 16, np.float32), 1, group=group)
            elif rank == 1:
                commrt.recv(np.empty(1 << 16, np.float32), 0, group=group)
            commrt.barrier(group=group)  # not gone before its message arrived (1 s of linger)
        commrt.destroy_process_group(group)
        after = _memfds()
        assert after == before, f"group {i}: memory files (open, mapped) {before} before, {after} after"


def main() -> int:
    mode = sys.argv[1]
    print(f"pid: {os.getpid()}", flush=True)
    _announce_rings()
    commrt.init_process_group()
    rank, n = commrt.get_rank(), commrt.get_world_size()
    {"data": data, "kill": kill, "unreceived": unreceived, "mixed": mixed, "groups": groups}[mode](rank, n)
    engine = commrt.distributed._rt().world.backend._p2p
    rings = engine._rings
    used = bool(rings and rings.used())
    if mode == "data":  # comm_stats counts what each rank sent, whichever way it went
        p2p = commrt.comm_stats()["by_op"]["p2p"]
        sends = sent_sizes(rank, n)
        # a message is one piece of at most chunk_bytes (an empty send is one message too)
        chunk = commrt.distributed.get_config().comm.chunk_bytes
        want = {"intra_node_bytes": sum(sends), "inter_node_bytes": 0,
                "messages": sum(max(1, -(-b // chunk)) for b in sends)}
        assert p2p == want, (p2p, want)
    mailed = rings.mailed if rings else 0
    sock = sum(r.outbox.sock_sent for r in rings._out.values()) if rings else 0
    print(f"rank {rank}: p2p {mode} passed, rings used {used}, mailed {mailed}, socket {sock}", flush=True)
    if mode != "data":
        os._exit(0)  # the group's peer is gone: skip the goodbye barrier
    commrt.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
