"""keep_freed_memory: freed multi-MiB buffers are reused instead of page-faulted in again.
Run in fresh interpreters so this test process's allocator stays as it was.

The setting is process-wide, so the library leaves it off (a process that merely uses commrt
keeps glibc's defaults); ``commrt launch`` gives its ranks the same thresholds through
GLIBC_TUNABLES, read by glibc at their start."""
import io
import os
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
if sys.argv[1] == "library":  # what a library user does: a whole (one-rank) job, default config
    import commrt, torch
    from commrt.launch import free_port
    port = free_port()
    commrt.init_process_group(backend="zmq", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    commrt.all_reduce(torch.ones(1 << 20))
    commrt.destroy_process_group()
import os  # (not /proc/self/environ: glibc 2.36 cuts the copy there at the first ':' it parses)
print("tunables", [os.environ["GLIBC_TUNABLES"]] if "GLIBC_TUNABLES" in os.environ else [])
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
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "COMMRT_COMM_KEEP_FREED_MEMORY")}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], cwd=ROOT, capture_output=True, env=env,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return int(out.stdout.split()[-1])


def _launched(env: dict) -> tuple[int, str]:
    """Faults per round and the GLIBC_TUNABLES line of a rank started by ``commrt launch``."""
    from commrt.launch import launch
    out = io.StringIO()
    result = launch(1, [sys.executable, "-c", PROBE, "default"], out=out, env=env, timeout_s=120, prefix=False)
    assert result.returncode == 0, out.getvalue()
    lines = out.getvalue().splitlines()
    return int(lines[-1]), next(line for line in lines if line.startswith("tunables"))


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc thresholds only")
def test_freed_buffers_are_reused_without_page_faults():
    default, kept = _faults_per_round("default"), _faults_per_round("keep")
    assert default >= 1000, f"glibc's default should refault the 16 MiB each round; saw {default} faults"
    assert kept < 50, f"with keep_freed_memory the pages should be reused; saw {kept} faults per round"


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc thresholds only")
def test_a_library_user_keeps_glibc_defaults():
    """Before: keep_freed_memory was on by default, so init_process_group changed the malloc
    thresholds of the user's whole process (memory never shrank back)."""
    faults = _faults_per_round("library")
    assert faults >= 1000, f"commrt changed this process's malloc thresholds: {faults} faults per round"


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc thresholds only")
def test_launched_ranks_get_the_tunables_and_keep_the_speed():
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    env["PYTHONPATH"] = str(ROOT)
    faults, line = _launched(env)
    assert "glibc.malloc.mmap_threshold=33554432" in line and "glibc.malloc.trim_threshold=268435456" in line, line
    assert faults < 50, f"a launched rank should reuse freed pages; saw {faults} faults per round"
    # the user's own tunables are kept, and the user's own malloc settings win
    faults, line = _launched({**env, "GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0:glibc.malloc.tcache_count=0"})
    assert "glibc.malloc.tcache_count=0" in line and "trim_threshold=268435456" not in line, line
    # and COMMRT_COMM_KEEP_FREED_MEMORY=0 turns it off for the job
    faults, line = _launched({**env, "COMMRT_COMM_KEEP_FREED_MEMORY": "0"})
    assert line == "tunables []" and faults >= 1000, (line, faults)
