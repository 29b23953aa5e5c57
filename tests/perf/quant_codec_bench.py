"""Codec throughput on one core against memcpy (issue 15): GB/s of fp32 input per second for
encode and decode (int8 / int4, block 256) and for ``np.copyto`` of the same bytes, sample by
sample alternated, median of the samples. The torch codec (torch_codec.py) adds rows: on the
CPU with one torch thread (what a rank would get on a shared host), and on CUDA when there is a
GPU (synchronized around each sample). Run it alone:
``flock /work/notes/bench.lock python -m tests.perf.quant_codec_bench [MiB] [samples]``."""
from __future__ import annotations

import statistics
import sys
import time

import numpy as np

import torch

from commrt.quant import codec_for, torch_codec


def main() -> None:
    mib = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    samples = int(sys.argv[2]) if len(sys.argv) > 2 else 9
    x = np.random.default_rng(0).standard_normal(mib << 18).astype(np.float32)
    dst = np.empty_like(x)
    codecs = {name: codec_for(name) for name in ("int8", "int4")}
    bufs = {name: np.empty(c.nbytes(x.size), dtype=np.uint8) for name, c in codecs.items()}
    out = np.empty_like(x)
    steps = {"memcpy": lambda: np.copyto(dst, x)}
    for name, c in codecs.items():
        steps[f"{name} encode"] = lambda c=c, b=bufs[name]: c.encode_into(b, x)
        steps[f"{name} decode"] = lambda c=c, b=bufs[name]: c.decode(b, x.size, out=out)
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    for dev in devices:
        steps.update(_torch_steps(codecs, torch.from_numpy(x).to(dev)))
    torch.set_num_threads(1)
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(samples + 1):
        for k, fn in steps.items():
            _sync()
            t0 = time.perf_counter()
            fn()
            _sync()
            times[k].append(time.perf_counter() - t0)
    base = statistics.median(times["memcpy"][1:])
    print(f"# {mib} MiB fp32, one core, median of {samples}; GB/s of fp32 input; x = vs memcpy")
    for k, ts in times.items():
        t = statistics.median(ts[1:])
        print(f"{k:24s} {x.nbytes / t / 1e9:7.2f} GB/s  {t * 1e3:8.2f} ms  {base / t:5.2f}x")


def _torch_steps(codecs: dict, xt: torch.Tensor) -> dict:
    steps, dev = {}, xt.device.type
    out = torch.empty_like(xt)
    for name, c in codecs.items():
        buf = torch.empty(c.nbytes(xt.numel()), dtype=torch.uint8, device=xt.device)
        steps[f"torch {dev} {name} encode"] = lambda c=c, b=buf: torch_codec.encode_into(c, b, xt)
        steps[f"torch {dev} {name} decode"] = lambda c=c, b=buf: torch_codec.decode(c, b, xt.numel(), out=out)
    return steps


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
