"""Shared-memory segments without names (issue 30.1-3): anonymous memory files made with
``memfd_create``, mapped by their creator and handed to the node's peers as file descriptors
over an authenticated Unix socket (handoff.py); the Channel over them is shm.py's.

Nothing appears in /dev/shm or any other directory, so no other process can list or open a
segment, nothing needs sweeping, and the memory goes with the last process that maps it or
holds its descriptor: a SIGKILL at any moment leaves nothing behind. A segment is sealed
against shrinking and growing before anyone else sees it, so no holder can truncate it under
the others (which would turn their next access into SIGBUS), and its memory is reserved when it
is made (a full memory cgroup fails here with OSError, not later with SIGBUS); rings reserve on
first use (``reserve``), since most pairs never carry a large point-to-point payload.
"""
from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
import platform
import socket
import stat

from commrt.runtime.errors import ProtocolError

SLOT_BYTES = 4 << 20  # one step's data per rank; large payloads are pipelined through it
CTL_BYTES = 8192
MAGIC = 0x316D6873746D6D63  # b"cmmtshm1", little-endian
W_MAGIC = 0
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL  # the size is fixed for good


def supported() -> str | None:
    """Why shared memory cannot be used on this host, or None."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the step counters rely on x86-64 store ordering (this host is {platform.machine()})"
    if not hasattr(os, "memfd_create") or not hasattr(socket, "send_fds"):
        return "this Python has no os.memfd_create or socket.send_fds (Linux, Python 3.9+)"
    return None


def node_key(environ=os.environ) -> str:
    """Equal for processes that can share memory and sockets alike: one boot of one host, in
    one network namespace (emulated nodes are namespaces on one machine; the handoff's abstract
    Unix sockets live in it too), and, when the launcher numbers nodes (torchrun's GROUP_RANK),
    one node: the topology's nodes, never more."""
    parts = [socket.gethostname(), environ.get("GROUP_RANK", "")]
    for path in ("/proc/sys/kernel/random/boot_id",):
        try:
            with open(path) as f:
                parts.append(f.read().strip())
        except OSError:
            pass
    try:
        parts.append(str(os.stat("/proc/self/ns/net").st_ino))
    except OSError:
        pass
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def segment_bytes(slot_bytes: int = SLOT_BYTES) -> int:
    return CTL_BYTES + 2 * slot_bytes


def create(slot_bytes: int = SLOT_BYTES, reserve_now: bool = True) -> tuple[int, mmap.mmap]:
    """A new sealed segment: (its descriptor, close-on-exec, for the handoff; its mapping, with
    the magic written). ``reserve_now`` False leaves its pages unallocated until ``reserve``."""
    size = segment_bytes(slot_bytes)
    fd = os.memfd_create("commrt", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        if reserve_now:
            os.posix_fallocate(fd, 0, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        mm = mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        raise
    ctl = memoryview(mm)[:CTL_BYTES].cast("q")
    ctl[W_MAGIC] = MAGIC
    ctl.release()
    return fd, mm


def reserve(fd: int) -> None:
    """Allocate every page of a segment made with ``reserve_now`` False (OSError when memory
    is short: the caller falls back to the socket instead of meeting SIGBUS mid-copy)."""
    os.posix_fallocate(fd, 0, os.fstat(fd).st_size)


def attach(fd: int, slot_bytes: int = SLOT_BYTES) -> mmap.mmap:
    """Map a segment a peer handed us after checking that it is one of ours: a memory file of
    this user, sealed at the expected size, with the magic. The descriptor stays the caller's."""
    want = segment_bytes(slot_bytes)
    st = os.fstat(fd)
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0  # not a memfd
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size != want or seals & SEALS != SEALS:
        raise ProtocolError(f"a shared-memory segment handed over is not a sealed memory file of this "
                            f"user of {want} bytes (size {st.st_size}, seals {seals:#x})")
    mm = mmap.mmap(fd, want)
    ctl = memoryview(mm)[:CTL_BYTES].cast("q")
    magic = ctl[W_MAGIC]
    ctl.release()
    if magic != MAGIC:
        mm.close()
        raise ProtocolError("a shared-memory segment handed over has no commrt header")
    return mm


def close_fd(fd: int | None) -> None:
    if fd is not None and fd >= 0:
        try:
            os.close(fd)
        except OSError:
            pass
