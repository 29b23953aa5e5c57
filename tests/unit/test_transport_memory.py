"""keep_freed_memory: freed multi-MiB buffers are reused instead of page-faulted in again.
Run in fresh interpreters so this test process's allocator stays as it was."""
import pathlib
import platform
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

PROBE = r"""
import ctypes, resource, sys
if sys.argv[1] == "keep":
    from commrt.transport.memory import keep_freed_memory
    assert keep_freed_memory() and keep_freed_memory()  # idempotent
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]

def round_():  # what libzmq does with received pieces: allocate, fill, free, four at a time
    ps = [libc.malloc(4 << 20) for _ in range(4)]
    for p in ps:
        libc.memset(p, 1, 4 << 20)
    for p in ps:
        libc.free(p)

round_()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    round_()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) // 10)
"""


def _faults_per_round(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc thresholds only")
def test_freed_buffers_are_reused_without_page_faults():
    default, kept = _faults_per_round("default"), _faults_per_round("keep")
    assert default >= 1000, f"glibc's default should refault the 16 MiB each round; saw {default} faults"
    assert kept < 50, f"with keep_freed_memory the pages should be reused; saw {kept} faults per round"
