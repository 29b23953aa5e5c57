"""Each mode makes the job go wrong on purpose; every rank must end with the right typed
error (printed as 'CAUGHT <type>: <message>') instead of hanging or returning garbage."""
from __future__ import annotations

import faulthandler
import os
import sys
import time

import torch

import commrt

RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def run(mode: str) -> None:
    if mode == "missing":
        commrt.init_process_group(world_size=WORLD + 1, timeout=3)
    elif mode == "duplicate":
        commrt.init_process_group(rank=min(RANK, 1), timeout=10)
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
    else:
        commrt.init_process_group(timeout=3)
        collective(mode)
    commrt.destroy_process_group()


def collective(mode: str) -> None:
    if mode == "dtype":
        commrt.all_reduce(torch.ones(100, dtype=torch.float32 if RANK == 0 else torch.float64))
    elif mode == "count":
        commrt.all_reduce(torch.ones(100 + (RANK == 0)))
    elif mode == "skip":  # rank 0 skips one all_reduce; the next ones must not pair up wrongly
        if RANK != 0:
            commrt.all_reduce(torch.ones(8))
        commrt.all_reduce(torch.ones(8))
    elif mode == "op":
        if RANK == 0:
            commrt.all_reduce(torch.ones(8))
        else:
            commrt.all_gather_into_tensor(torch.ones(8 * WORLD), torch.ones(8))
    elif mode == "dead":
        commrt.all_reduce(torch.ones(10))
        if RANK == WORLD - 1:
            os._exit(0)  # leaves without a word
        started = time.monotonic()
        try:
            commrt.all_reduce(torch.ones(1 << 20))
        finally:
            print(f"detected after {time.monotonic() - started:.2f}s", flush=True)
    elif mode == "after_error":
        try:
            collective("dtype")
        except commrt.CollectiveMismatch:
            pass
        commrt.all_reduce(torch.ones(3))  # the group is poisoned: must refuse, not misbehave


def _config_file(chunk: int) -> str:
    path = f"/tmp/commrt-test-{os.getpid()}.toml"
    with open(path, "w") as fh:
        fh.write(f"[comm]\nchunk_bytes = {chunk}\ntimeout_s = 3\n")
    return path


if __name__ == "__main__":
    try:
        run(sys.argv[1])
    except commrt.CommError as exc:
        print(f"CAUGHT {type(exc).__name__}: {exc}", flush=True)
        sys.exit(0)
    print("NO ERROR", flush=True)
    sys.exit(3)
