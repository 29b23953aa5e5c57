"""Shared-memory segment files: made, checked, mapped and removed (the Channel over them is
shm.py's). A segment is a file under /dev/shm opened with O_CREAT | O_EXCL | O_NOFOLLOW and
mode 0600, named by 128 random bits that travel only in the group's authenticated address
exchange, mapped with mmap (not multiprocessing.shared_memory, whose resource tracker unlinks a
segment when any process that attached to it exits, cpython 82300). Its creator unlinks it at
exit at the latest; ``sweep`` removes those of creators that died first.
"""
from __future__ import annotations

import atexit
import hashlib
import mmap
import os
import platform
import re
import secrets
import socket
import stat

from commrt.runtime.errors import ProtocolError

SHM_DIR = "/dev/shm"
SLOT_BYTES = 4 << 20  # one step's data per rank; large payloads are pipelined through it
CTL_BYTES = 8192
MAGIC = 0x316D6873746D6D63  # b"cmmtshm1", little-endian
W_MAGIC = 0
_NAME = re.compile(r"commrt-[0-9]+-[0-9a-f]{32}")
_mine: set[str] = set()  # created by this process and not unlinked yet: atexit unlinks them


def supported() -> str | None:
    """Why shared memory cannot be used on this host, or None."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the step counters rely on x86-64 store ordering (this host is {platform.machine()})"
    if not os.access(SHM_DIR, os.W_OK):
        return f"{SHM_DIR} is not writable"
    return None


def node_key(environ=os.environ) -> str:
    """Equal for processes that can share memory and sockets alike: one boot of one host, in
    one network namespace (emulated nodes are namespaces on one machine), and, when the
    launcher numbers nodes (torchrun's GROUP_RANK), one node: the topology's nodes, never more."""
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


def create(slot_bytes: int = SLOT_BYTES) -> tuple[str, mmap.mmap]:
    """A new 0600 segment under an unguessable name, its memory reserved now (a full /dev/shm
    fails here with OSError, not later with SIGBUS)."""
    sweep()
    name = f"commrt-{os.getpid()}-{secrets.token_hex(16)}"
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.posix_fallocate(fd, 0, segment_bytes(slot_bytes))
        mm = mmap.mmap(fd, segment_bytes(slot_bytes))
    except BaseException:
        unlink(name)
        raise
    finally:
        os.close(fd)
    _mine.add(name)
    ctl = memoryview(mm)[:CTL_BYTES].cast("q")
    ctl[W_MAGIC] = MAGIC
    ctl.release()
    return name, mm


def attach(name: str, slot_bytes: int = SLOT_BYTES) -> mmap.mmap:
    """Map a peer's segment after checking that it is one of ours: our name pattern, a regular
    file of this user with mode 0600, the expected size and magic."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ProtocolError(f"invalid shared-memory segment name {name!r}")
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        want = segment_bytes(slot_bytes)
        if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid()
                or stat.S_IMODE(st.st_mode) != 0o600 or st.st_size != want):
            raise ProtocolError(f"shared-memory segment {name} is not a 0600 file of this user "
                                f"of {want} bytes")
        mm = mmap.mmap(fd, want)
    finally:
        os.close(fd)
    ctl = memoryview(mm)[:CTL_BYTES].cast("q")
    magic = ctl[W_MAGIC]
    ctl.release()
    if magic != MAGIC:
        mm.close()
        raise ProtocolError(f"shared-memory segment {name} has no commrt header")
    return mm


def unlink(name: str) -> None:
    if _NAME.fullmatch(name or ""):
        _mine.discard(name)
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except FileNotFoundError:
            pass


def sweep() -> None:
    """Unlink our user's segments whose creator process is gone: one SIGKILLed before its
    group's address exchange, when no peer knew the name to remove it (the name carries the
    creator's pid; the 128-bit token keeps it unguessable)."""
    try:
        entries = os.listdir(SHM_DIR)
    except OSError:
        return
    for name in entries:
        if not _NAME.fullmatch(name):
            continue
        pid = int(name.split("-")[1])
        try:
            os.kill(pid, 0)
            continue  # alive (or not ours to signal): leave it
        except ProcessLookupError:
            pass
        except OSError:
            continue
        try:
            if os.stat(os.path.join(SHM_DIR, name)).st_uid == os.getuid():
                unlink(name)
        except OSError:
            pass


@atexit.register
def _unlink_mine() -> None:
    for name in list(_mine):
        unlink(name)
