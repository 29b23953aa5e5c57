"""A same-user process without the job secret tries to get at a job's shared memory (issue 30.1).

    shm_intruder            the job: 2 ranks on shared memory. Rank 1 starts the intruder with
                            rank 0's segment made and its handoff socket waiting for rank 1,
                            then sets up; both check all_reduce results against the reference
    shm_intruder attack PIDS  the intruder (no COMMRT_JOB_SECRET in its environment): maps every
                            /dev/shm file of the job's processes it can (the old attack), and
                            runs the handshake, with secrets it guesses, on every Unix socket
                            those processes listen on, found in /proc/net/unix
Prints ``intruder: mapped M obtained O refused R sockets S`` and ``dev_shm: NAMES`` lines."""
from __future__ import annotations

import mmap
import os
import socket
import subprocess
import sys
import time

import numpy as np

import commrt
from commrt.transport import handoff


def job_pids() -> list[int]:
    """This rank and its siblings (the launcher's other ranks)."""
    me, parent = os.getpid(), os.getppid()
    out = [me]
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != me:
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == parent:
                        out.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return out


def dev_shm_of(pids: list[int]) -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if any(n.startswith(f"commrt-{p}-") for p in pids))


def _socket_names(pids: list[int]) -> list[str]:
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            pass
    names = []
    with open("/proc/net/unix") as f:
        for line in f.readlines()[1:]:
            cols = line.split()
            if len(cols) >= 8 and cols[6] in inodes and cols[7].startswith("@commrt-"):
                names.append(cols[7][1:])
    return sorted(set(names))


def _handshake(name: str, guess: bytes) -> tuple[bytes, list[int]]:
    """The client's side of the handshake as rank 1, with a guessed secret."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(5)
        try:
            sock.connect("\0" + name)
            ns, nc = sock.recv(256)[len(handoff.HELLO):], os.urandom(handoff.NONCE)
            sock.send(handoff._ANSWER.pack(handoff.HELLO, 1, nc, handoff.proof(guess, b"client", name, ns, nc, 1)))
            reply, fds, _, _ = socket.recv_fds(sock, 256, handoff.MAX_FDS)
        except OSError:  # refused at connect, timed out, hung up on
            return b"", []
        return reply, fds


def attack(pids: list[int]) -> None:
    mapped = obtained = refused = 0
    for name in dev_shm_of(pids):
        try:
            fd = os.open(os.path.join("/dev/shm", name), os.O_RDWR)
            mmap.mmap(fd, os.fstat(fd).st_size).close()
            mapped += 1
        except OSError:
            pass
    sockets = _socket_names(pids)
    for name in sockets:
        for guess in (b"", b"not the job secret", os.environ.get("COMMRT_JOB_SECRET", "x").encode()):
            reply, fds = _handshake(name, guess)
            obtained += len(fds)  # a real intruder keeps what it gets, proof or not
            refused += reply == handoff.REFUSED
    print(f"intruder: mapped {mapped} obtained {obtained} refused {refused} sockets {len(sockets)}", flush=True)


def _start_intruder_before_setup() -> None:
    exchange = handoff.Handoff.exchange

    def intrude_then_exchange(self, *a, **k):
        if os.environ["RANK"] == "1":
            pids = job_pids()
            print(f"dev_shm: {' '.join(dev_shm_of(pids)) or '-'}", flush=True)
            pids.remove(os.getpid())  # our own socket is not served yet: attack rank 0's
            env = {k: v for k, v in os.environ.items() if k != "COMMRT_JOB_SECRET"}
            subprocess.run([sys.executable, "-m", "tests.multirank.programs.shm_intruder", "attack",
                            *map(str, pids)], env=env, check=True, timeout=60)
        return exchange(self, *a, **k)
    handoff.Handoff.exchange = intrude_then_exchange


def job() -> None:
    _start_intruder_before_setup()
    commrt.init_process_group()
    rank, n = commrt.get_rank(), commrt.get_world_size()
    assert commrt.distributed._rt().world.backend._shm is not None, "the job should run on shared memory"
    for numel in (7, 1 << 12, 1 << 20):
        for _ in range(20):
            t = np.full(numel, float(rank + 1), np.float32)
            commrt.all_reduce(t)
            assert np.array_equal(t, np.full(numel, float(n * (n + 1) // 2), np.float32)), "all_reduce came back wrong"
    print(f"dev_shm: {' '.join(dev_shm_of(job_pids())) or '-'}", flush=True)
    commrt.destroy_process_group()
    print("intruder job passed", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["attack"]:
        attack([int(p) for p in sys.argv[2:]])
    else:
        job()
