"""Printing benchmark rows the way nccl-tests does, plus JSON and an optional plot."""
from __future__ import annotations

import json
import platform
import time

from .runner import BenchSpec


def _redop(spec: BenchSpec) -> str:
    return spec.op.lower() if spec.collective in ("all_reduce", "reduce_scatter", "reduce") else "none"


def table(spec: BenchSpec, nproc: int, rows: list[dict]) -> str:
    names = list(spec.backends)
    first = names[0]
    head1 = f"#{'':>10} {'':>12} {'':>8} {'':>6}"
    head2 = f"#{'size':>10} {'count':>12} {'type':>8} {'redop':>6}"
    head3 = f"#{'(B)':>10} {'(elements)':>12} {'':>8} {'':>6}"
    for name in names:
        head1 += f" {name:^36}"
        head2 += f" {'time':>9} {'algbw':>8} {'busbw':>8} {'#wrong':>8}"
        head3 += f" {'(us)':>9} {'(GB/s)':>8} {'(GB/s)':>8} {'':>8}"
        if name != first:
            head2 += f" {'ratio':>6}"
            head3 += f" {'':>6}"
            head1 += f" {'':>6}"
    if spec.physical:
        head2 += f" {'ceiling':>8}" + "".join(f" {'eff:' + n:>10}" for n in names)
        head3 += f" {'(GB/s)':>8}" + "".join(f" {'(%)':>10}" for _ in names)
    lines = [f"# commrt bench {spec.collective}: nproc {nproc}, dtype {spec.dtype}, op {spec.op}, "
             f"iters {spec.iters}, warmup {spec.warmup}", "#", head1, head2, head3]
    for row in rows:
        base = row[first]
        line = f" {base['size']:>10} {base['count']:>12} {spec.dtype:>8} {_redop(spec):>6}"
        for name in names:
            r = row[name]
            line += f" {r['time_us']:>9.1f} {r['algbw']:>8.3f} {r['busbw']:>8.3f} {r['wrong']:>8}"
            if name != first:
                line += f" {ratio(base, r):>6.2f}"
        if spec.physical:
            ceil = row["ceiling"]
            line += f" {ceil:>8.3f}" + "".join(f" {100 * row[n]['busbw'] / ceil if ceil else 0:>10.1f}" for n in names)
        lines.append(line)
    lines.append("# Out of bounds values : " + ", ".join(
        f"{n} {sum(r[n]['wrong'] for r in rows)}" for n in names) + " (#wrong, all sizes)")
    lines.append("# Avg bus bandwidth    : " + ", ".join(
        f"{n} {avg_busbw(rows, n):.3f} GB/s" for n in names))
    if len(names) > 1:
        lines.append(f"# ratio = that backend's time / {first}'s time (> 1: {first} is faster)")
    return "\n".join(lines)


def ratio(base: dict, other: dict) -> float:
    """How many times faster the first backend is: other's time / first's time."""
    return other["time_us"] / base["time_us"] if base["time_us"] else 0.0


def avg_busbw(rows: list[dict], name: str) -> float:
    return sum(r[name]["busbw"] for r in rows) / len(rows) if rows else 0.0


def to_json(spec: BenchSpec, nproc: int, rows: list[dict], command: str) -> dict:
    return {
        "tool": "commrt bench", "command": command, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": platform.node(), "collective": spec.collective, "nproc": nproc, "dtype": spec.dtype,
        "op": spec.op, "iters": spec.iters, "warmup": spec.warmup, "backends": list(spec.backends),
        "rows": rows, "avg_busbw": {n: avg_busbw(rows, n) for n in spec.backends},
    }


def write_json(path: str, doc: dict) -> None:
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=1)
        fh.write("\n")


def plot(path: str, spec: BenchSpec, nproc: int, rows: list[dict]) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from None
    fig, ax = plt.subplots(figsize=(7, 4))
    sizes = [r[spec.backends[0]]["size"] for r in rows]
    for name in spec.backends:
        ax.plot(sizes, [r[name]["busbw"] for r in rows], marker="o", label=name)
    if spec.physical:
        ax.plot(sizes, [r["ceiling"] for r in rows], linestyle="--", color="grey", label="TCP ring ceiling")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("size (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(f"{spec.collective}, {nproc} ranks, {spec.dtype}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
