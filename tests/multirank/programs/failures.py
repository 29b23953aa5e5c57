"""Each mode makes the job go wrong on purpose; every rank must end with the right typed
error (printed as 'CAUGHT <type>: <message>') instead of hanging or returning garbage."""
from __future__ import annotations

import faulthandler
import os
import sys
import time

import numpy as np

import commrt
from commrt.runtime import bootstrap, rendezvous

RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
# Generous: on a slow shared machine the ranks reach init seconds apart; only "missing" must
# wait its timeout out, after a start line that takes the start-up skew out of it.
TIMEOUT_S = 30


def start_together() -> None:
    """Wait until every rank got here (files in COMMRT_TEST_START_DIR), with a deadline."""
    directory = os.environ["COMMRT_TEST_START_DIR"]
    open(os.path.join(directory, f"rank{RANK}"), "w").close()
    deadline = time.monotonic() + 120
    while len(os.listdir(directory)) < WORLD:
        if time.monotonic() > deadline:
            raise SystemExit(f"rank {RANK}: the other ranks never started")
        time.sleep(0.02)


def run(mode: str) -> None:
    if mode == "missing":
        start_together()
        commrt.init_process_group(world_size=WORLD + 1, timeout=3)
    elif mode == "duplicate":
        commrt.init_process_group(rank=min(RANK, 1), timeout=TIMEOUT_S)
    elif mode == "curve_mix":  # rank 1 has no keys: it must not get into a CURVE job
        if RANK == 1:
            os.environ["COMMRT_SECURITY_MODE"] = "none"
        commrt.init_process_group(timeout=3)
    elif mode == "secret_mix":  # rank 1 holds another secret: it must not get into the job
        faulthandler.dump_traceback_later(30, exit=True)  # a hang shows where, instead of timing out
        if RANK == 1:
            os.environ["COMMRT_JOB_SECRET"] = "not-the-secret-of-this-job"
        commrt.init_process_group(timeout=3)
    elif mode == "config":
        commrt.init_process_group(config=_config_file(chunk=(1 << 20) + RANK * 4096))
    elif mode == "version":  # rank 1 speaks another wire protocol version
        if RANK == 1:
            rendezvous.VERSION += 1
        commrt.init_process_group(timeout=TIMEOUT_S)
    elif mode == "world_size":  # rank 1 thinks the world has one more rank (it waits for it briefly)
        start_together()
        commrt.init_process_group(world_size=WORLD + (RANK == 1), timeout=TIMEOUT_S if RANK == 0 else 5)
    elif mode == "nccl_half":
        import torch  # the one mode on torch: a torch process group stands in for NCCL
        nccl_fails_on(1)
        commrt.init_process_group(backend="auto", timeout=TIMEOUT_S)
        t = torch.full((5,), float(RANK + 1))
        commrt.all_reduce(t)
        assert torch.equal(t, torch.full((5,), float(sum(range(1, WORLD + 1))))), t
        print(f"OK rank {RANK} fell back to {commrt.get_backend()}", flush=True)
    else:
        commrt.init_process_group(timeout=TIMEOUT_S)
        collective(mode)
    commrt.destroy_process_group()


def collective(mode: str) -> None:
    if mode == "dtype":
        commrt.all_reduce(np.ones(100, np.float32 if RANK == 0 else np.float64))
    elif mode == "count":
        commrt.all_reduce(np.ones(100 + (RANK == 0), np.float32))
    elif mode == "skip":  # rank 0 skips one all_reduce; the next ones must not pair up wrongly
        if RANK != 0:
            commrt.all_reduce(np.ones(8, np.float32))
        commrt.all_reduce(np.ones(8, np.float32))
    elif mode == "op":
        if RANK == 0:
            commrt.all_reduce(np.ones(8, np.float32))
        else:
            commrt.all_gather_into_tensor(np.ones(8 * WORLD, np.float32), np.ones(8, np.float32))
    elif mode == "root_broadcast":  # each of 2 ranks takes the other for the root
        commrt.broadcast(np.ones(8, np.float32), src=1 - RANK)
        commrt.barrier()
    elif mode == "root_reduce":  # rank 0 reduces to itself, the others to rank 1
        commrt.reduce(np.ones(8, np.float32), dst=0 if RANK == 0 else 1)
        commrt.barrier()  # a leaf whose reduce only sent learns of it here
    elif mode == "dead":
        commrt.all_reduce(np.ones(10, np.float32))
        if RANK == WORLD - 1:
            os._exit(0)  # leaves without a word
        started = time.monotonic()
        try:
            commrt.all_reduce(np.ones(1 << 20, np.float32))
        finally:
            print(f"detected after {time.monotonic() - started:.2f}s", flush=True)
    elif mode == "after_error":
        try:
            collective("dtype")
        except commrt.CollectiveMismatch:
            pass
        commrt.all_reduce(np.ones(3, np.float32))  # the group is poisoned: must refuse, not misbehave


def nccl_fails_on(victim: int) -> None:
    """Simulate a GPU box where NCCL's initialisation fails on one rank and works on the others
    (gloo stands in for NCCL where it works: a real torch process group that must be torn down)."""
    import torch
    real = bootstrap._init_torch

    def init_torch(name, store, spec, *rest, **kw):
        if name != "nccl":
            return real(name, store, spec, *rest, **kw)
        backend = real("gloo", store, spec, *rest, **kw)
        if spec.rank == victim:
            torch.distributed.destroy_process_group()
            raise RuntimeError(f"simulated NCCL failure on rank {victim}: ncclUnhandledCudaError")
        return backend
    bootstrap._init_torch = init_torch
    bootstrap.choose_backend = lambda requested, local: ("nccl", "simulated GPU box")
    bootstrap.devices.problems = lambda gpus, layout: []  # one GPU per rank, as on the box simulated


def _config_file(chunk: int) -> str:
    path = f"/tmp/commrt-test-{os.getpid()}.toml"
    with open(path, "w") as fh:
        fh.write(f"[comm]\nchunk_bytes = {chunk}\ntimeout_s = {TIMEOUT_S}\n")
    return path


if __name__ == "__main__":
    try:
        run(sys.argv[1])
        if sys.argv[1] == "nccl_half":  # the one mode that must succeed
            sys.exit(0)
    except commrt.CommError as exc:
        print(f"CAUGHT {type(exc).__name__}: {exc}", flush=True)
        sys.exit(0)
    print("NO ERROR", flush=True)
    sys.exit(3)
