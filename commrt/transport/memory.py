"""Let freed message buffers be reused instead of handed back to the kernel (glibc only).

libzmq receives every message into a buffer it mallocs. glibc serves a multi-MiB request
with a fresh mmap, or trims the heap once it is freed, so each received piece lands in pages
the kernel must fault in and zero again: 1500 (n=2) to 4000 (n=4) minor faults per 64 MiB
all_reduce here, about a tenth of a rank's CPU time. Fixing glibc's two thresholds keeps
those pages in the process for the next piece: faults drop to ~0 (docs/PERFORMANCE.md).

The cost is the usual one of a caching allocator: memory freed below the trim threshold stays
in the process (RSS does not shrink back after a peak), and mallopt changes the whole process.
So the library leaves it off (``[comm] keep_freed_memory = true`` opts in); ``commrt launch``
instead starts its ranks and servers with the same two thresholds in GLIBC_TUNABLES
(``glibc_tunables``), which glibc reads at start-up: launched jobs keep the speed, and a process
that merely imports commrt keeps glibc's defaults.
"""
from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers
MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed value: requests below it reuse the heap
TRIM_THRESHOLD = 256 << 20  # free memory at the top of the heap kept before giving it back

_applied = False
TUNABLES = {"glibc.malloc.mmap_threshold": MMAP_THRESHOLD, "glibc.malloc.trim_threshold": TRIM_THRESHOLD}


def glibc_tunables(existing: str = "") -> str:
    """A GLIBC_TUNABLES value with the buffer-reuse thresholds added to ``existing`` (for a
    process about to start); a threshold already there is the user's choice and stays."""
    items = [item for item in existing.split(":") if item]
    have = {item.split("=", 1)[0] for item in items}
    return ":".join(items + [f"{k}={v}" for k, v in TUNABLES.items() if k not in have])


def keep_freed_memory() -> bool:
    """Set glibc's malloc thresholds once per process; False where libc is not glibc."""
    global _applied
    if _applied:
        return True
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # only glibc has it (musl's mallopt is a no-op, macOS has none)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        log.warning("mallopt refused the buffer-reuse thresholds; received pieces will page-fault")
        return False
    _applied = True
    return True
