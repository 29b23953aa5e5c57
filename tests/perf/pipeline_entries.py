"""Per received activation: the old leaf (requires_grad_) against runtime._entries (detach + sub_ of a zero
leaf + hook), forward through a Linear and backward, alternating rounds (docs/PERFORMANCE.md):

    flock -x /tmp/w/cpu.lock python -m tests.perf.pipeline_entries
"""
import statistics
import time

import torch

from commrt.pipeline.runtime import _entries

torch.set_num_threads(1)
lin = torch.nn.Linear(64, 64)


def old(buf, g):
    t = buf.view(torch.float32).view(-1, 64).requires_grad_()
    out = lin(t)
    torch.autograd.backward([out], [g])
    return t.grad


def new(buf, g):
    (t,), (cell,) = _entries([buf.view(torch.float32).view(-1, 64)], False)
    out = lin(t)
    torch.autograd.backward([out], [g])
    return cell[0]


for rows in (64, 4096):
    g = torch.randn(rows, 64)
    res = {"old": [], "new": []}
    for rnd in range(7):
        for name, fn in (("old", old), ("new", new)):
            bufs = [torch.randn(rows * 64).view(torch.uint8) for _ in range(200)]
            t0 = time.perf_counter()
            for b in bufs:
                fn(b, g)
            res[name].append((time.perf_counter() - t0) / len(bufs) * 1e6)
    o, n = statistics.median(res["old"]), statistics.median(res["new"])
    print(f"{rows} rows x 64 fp32 ({rows*256//1024} KiB): leaf {o:.1f} us, entries {n:.1f} us per forward+backward ({n/o:.3f}x)")
