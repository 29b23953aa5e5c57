"""Spawn real ranks on loopback (through our launcher) and surface the failing rank's output."""
from __future__ import annotations

import contextlib
import io
import os
import sys

from commrt.launch import Nodes, launch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_ranks(nproc: int, program: str, *args: str, timeout_s: float = 90.0,
              env: dict | None = None, expect_fail: bool = False, servers: int = 0,
              stop_on_failure: bool = True, master_addr: str = "127.0.0.1"):
    """Run ``python -m tests.multirank.programs.<program> args`` as ``nproc`` ranks."""
    out = io.StringIO()
    full_env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                "COMMRT_COMM_TIMEOUT_S": os.environ.get("COMMRT_COMM_TIMEOUT_S", "30"), **(env or {})}
    cmd = [sys.executable, "-m", f"tests.multirank.programs.{program}", *args]
    result = launch(nproc, cmd, out=out, timeout_s=timeout_s, env=full_env, servers=servers,
                    stop_on_failure=stop_on_failure, nodes=Nodes(master_addr=master_addr))
    text = out.getvalue()
    if result.returncode == 124:
        raise AssertionError(f"{program} x{nproc} timed out after {timeout_s}s; output:\n{text[-6000:]}")
    if not expect_fail and result.returncode != 0:
        raise AssertionError(f"{program} x{nproc}: {result.describe()}\n--- all output ---\n{text[-6000:]}")
    if expect_fail and result.returncode == 0:
        raise AssertionError(f"{program} x{nproc} was expected to fail but succeeded:\n{text[-3000:]}")
    return result, text


def default_signals() -> None:
    """``preexec_fn`` for a process a test will signal: SIGINT and SIGHUP at their defaults. A
    suite started in the background by a non-interactive shell has SIGINT ignored, under nohup
    SIGHUP too, and children inherit that: a launcher that ignores the test's Ctrl-C or hang-up
    never exits (seen when this suite ran as ``nohup bash -c '.ci/run' &``)."""
    import signal
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def alive(pid: int) -> bool:
    """Whether process ``pid`` (one the test started) still exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@contextlib.contextmanager
def emulated_cluster(nnodes: int):
    """``nnodes`` network namespaces at 1 Gbit (commrt/emulate.py), removed on every exit path;
    the test skips where they cannot be made (not root, no ``ip``)."""
    from commrt import emulate  # the emulated tests only
    from commrt.runtime.errors import ConfigError
    try:
        emulate.check_usable(emulate.parse_shape("1gbit"))
    except ConfigError as exc:
        import pytest
        pytest.skip(str(exc))
    with emulate.cluster(nnodes, emulate.parse_shape("1gbit")) as net:
        yield net
