"""Printing benchmark rows the way nccl-tests does, plus JSON and an optional plot."""
from __future__ import annotations

import json
import math
import os
import platform
import time

from commrt.bench.runner import BenchSpec
from commrt.runtime.errors import ConfigError


def _redop(spec: BenchSpec) -> str:
    return spec.op.lower() if spec.collective in ("all_reduce", "reduce_scatter", "reduce") else "none"


def _has(rows: list[dict], name: str, key: str) -> bool:
    return bool(rows) and key in rows[0][name]


def _ceilings(row: dict, name: str) -> float:
    """The ceiling of the path this backend's bytes take (runner.data_path): TCP or memory."""
    if row[name].get("path") == "shm" and "memory" in row:
        return row["memory"]["busbw"]
    return row["ceiling"]


def table(spec: BenchSpec, nproc: int, rows: list[dict]) -> str:
    """Per backend: the back-to-back columns (time, algbw, busbw, #wrong[, ratio]) and, when
    measured, the op-by-op ones (median time, busbw[, ratio]); with --physical the TCP ring
    ceiling, the memory ceiling and each backend's efficiency against its own path's ceiling."""
    names = list(spec.backends)
    first = names[0]
    b2b = bool(rows) and "time_us" in rows[0][first]
    by_op = _has(rows, first, "alone")
    head1 = f"#{'':>10} {'':>12} {'':>8} {'':>6}"
    head2 = f"#{'size':>10} {'count':>12} {'type':>8} {'redop':>6}"
    head3 = f"#{'(B)':>10} {'(elements)':>12} {'':>8} {'':>6}"
    for name in names:
        ratios = 7 * ((b2b + by_op) if name != first else 0)  # " ratio" columns
        width = (36 if b2b else 8) + (29 if by_op else 0) + ratios
        head1 += f" {name:^{width}}"
        if b2b:
            head2 += f" {'time':>9} {'algbw':>8} {'busbw':>8} {'#wrong':>8}"
            head3 += f" {'(us)':>9} {'(GB/s)':>8} {'(GB/s)':>8} {'':>8}"
            if name != first:
                head2 += f" {'ratio':>6}"
                head3 += f" {'':>6}"
        else:
            head2 += f" {'#wrong':>8}"
            head3 += f" {'':>8}"
        if by_op:
            head2 += f" {'alone':>9} {'p90':>9} {'busbw':>8}"
            head3 += f" {'(us)':>9} {'(us)':>9} {'(GB/s)':>8}"
            if name != first:
                head2 += f" {'ratio':>6}"
                head3 += f" {'':>6}"
    if spec.physical:
        head2 += f" {'ceiling':>8} {'memcpy':>7} {'reduce':>7} {'mem-ceil':>8}" + "".join(
            f" {'eff:' + n:>{_eff_width(n)}}" for n in names)
        head3 += f" {'(GB/s)':>8} {'(GB/s)':>7} {'(GB/s)':>7} {'(GB/s)':>8}" + "".join(
            f" {'(%)':>{_eff_width(n)}}" for n in names)
    lines = [f"# commrt bench {spec.collective}: nproc {nproc}, dtype {spec.dtype}, op {spec.op}, "
             f"iters {spec.iters}, warmup {spec.warmup}, mode {spec.mode}, input {spec.input}", "#",
             head1, head2, head3]
    for row in rows:
        lines.append(_line(spec, names, row, b2b, by_op))
    lines.append("# Out of bounds values : " + ", ".join(
        f"{n} {sum(r[n]['wrong'] for r in rows)}" for n in names) + " (#wrong, all sizes)")
    if b2b:
        lines.append("# Avg bus bandwidth    : " + ", ".join(f"{n} {avg_busbw(rows, n):.3f} GB/s" for n in names))
    if by_op:
        lines.append("# Avg bus bw, op by op : " + ", ".join(
            f"{n} {avg_busbw(rows, n, 'alone'):.3f} GB/s" for n in names))
        lines.append("# alone = median over samples of the slowest rank's time of one op (input rewritten, "
                     "barrier, one op; backends alternating sample by sample); p90 = its 90th percentile")
    if len(names) > 1:
        lines.append(f"# ratio = that backend's time / {first}'s time (> 1: {first} is faster)")
    if spec.physical:
        lines.append("# eff = busbw (op by op if measured, else back-to-back) / the ceiling of the backend's "
                     "path: " + ", ".join(f"{n} {rows[0][n].get('path', 'tcp')}" for n in names if rows)
                     + " (tcp: the TCP ring ceiling; shm: mem-ceil, from memcpy and reduce)")
    return "\n".join(lines)


def _line(spec: BenchSpec, names: list[str], row: dict, b2b: bool, by_op: bool) -> str:
    first = names[0]
    base = row[first]
    line = f" {base['size']:>10} {base['count']:>12} {spec.dtype:>8} {_redop(spec):>6}"
    for name in names:
        r = row[name]
        if b2b:
            line += f" {r['time_us']:>9.1f} {r['algbw']:>8.3f} {r['busbw']:>8.3f} {r['wrong']:>8}"
            if name != first:
                line += f" {ratio(base, r):>6.2f}"
        else:
            line += f" {r['wrong']:>8}"
        if by_op:
            a = r["alone"]
            line += f" {a['time_us']:>9.1f} {a['p90_us']:>9.1f} {a['busbw']:>8.3f}"
            if name != first:
                line += f" {ratio(base['alone'], a):>6.2f}"
    if spec.physical:
        mem = row.get("memory", {"memcpy": 0.0, "reduce": 0.0, "busbw": 0.0})
        line += f" {row['ceiling']:>8.3f} {mem['memcpy']:>7.2f} {mem['reduce']:>7.2f} {mem['busbw']:>8.3f}"
        for n in names:
            bw = row[n]["alone"]["busbw"] if by_op else row[n]["busbw"]
            ceil = _ceilings(row, n)
            line += f" {100 * bw / ceil if ceil else 0:>{_eff_width(n)}.1f}"
    return line


def _eff_width(name: str) -> int:
    """The efficiency column of ``name``: as wide as its header, 'eff:zmq:recursive_doubling'
    (a --algo column) was 16 characters wider than its figures, which then sat under the wrong
    header."""
    return max(10, len("eff:" + name))


def ratio(base: dict, other: dict) -> float:
    """How many times faster the first backend is: other's time / first's time."""
    return other["time_us"] / base["time_us"] if base["time_us"] else 0.0


def avg_busbw(rows: list[dict], name: str, mode: str | None = None) -> float:
    """Mean busbw over sizes, back-to-back (``mode`` None) or of the ``"alone"`` figures."""
    pick = (lambda r: r[name][mode]["busbw"]) if mode else (lambda r: r[name].get("busbw", 0.0))
    return sum(pick(r) for r in rows) / len(rows) if rows else 0.0


def to_json(spec: BenchSpec, nproc: int, rows: list[dict], command: str) -> dict:
    return {
        "tool": "commrt bench", "command": command, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": platform.node(), "collective": spec.collective, "nproc": nproc, "dtype": spec.dtype,
        "op": spec.op, "iters": spec.iters, "warmup": spec.warmup, "backends": list(spec.backends),
        "mode": spec.mode, "input": spec.input,
        "rows": rows, "avg_busbw": {n: avg_busbw(rows, n) for n in spec.backends},
        **({"avg_busbw_alone": {n: avg_busbw(rows, n, "alone") for n in spec.backends}}
           if rows and "alone" in rows[0][spec.backends[0]] else {}),
    }


def finite(obj):
    """``obj`` with every float that is not finite as None (JSON null): json.dump writes them
    as Infinity / NaN, which is not JSON (jq and JSON.parse refuse the file). --physical at one
    rank has no TCP link: its ceiling is inf."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def check_json_path(path: str | None) -> None:
    """Before any rank starts: ConfigError (a ValueError) when ``--json PATH`` cannot be written.
    The file is written after the whole run: a missing directory was rank 0's FileNotFoundError
    traceback at the end, and the run's figures went with it."""
    if not path:
        return
    where = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(where) or not os.access(where, os.W_OK):
        why = "is a directory" if os.path.isdir(path) else f"its directory {where} does not exist or is not writable"
        raise ConfigError(f"--json {path}: {why}")


def write_json(path: str, doc: dict) -> None:
    with open(path, "w") as fh:
        json.dump(finite(doc), fh, indent=1, allow_nan=False)
        fh.write("\n")


# Backends whose bytes go through torch's process groups: commrt's transport counters never see
# them, so a "0 B" there would be a claim we cannot make (issue 31.7).
UNCOUNTED = ("gloo", "nccl")


def traffic_lines(traffic: dict[str, dict]) -> str:
    """``# NAME: sent inside nodes X B, across nodes Y B`` per backend, all ranks and the whole run
    (warm-up and checks included); ``n/a`` for a backend commrt cannot count (gloo, nccl; ``auto``
    when it counted nothing, i.e. it resolved to nccl)."""
    lines = []
    for name, t in traffic.items():
        kind = name.split("+")[0].partition("@")[0]
        counted = kind not in UNCOUNTED and not (kind == "auto" and not any(
            t[k] for k in ("intra_node_bytes", "inter_node_bytes")))
        fmt = (lambda b: f"{b} B") if counted else (lambda b: "n/a")
        lines.append(f"# {name}: sent inside nodes {fmt(t['intra_node_bytes'])}, across nodes "
                     f"{fmt(t['inter_node_bytes'])}" + (f"; {t['quant']}" if "quant" in t else ""))
    if any(name.split("+")[0].partition("@")[0] in UNCOUNTED for name in traffic):
        lines.append("# n/a: that backend's bytes go through torch's process groups, which commrt does not count")
    return "\n".join(lines)


def plot_mode(rows: list[dict], name: str) -> str:
    """Which figures ``plot`` draws: the back-to-back loop's when measured, else the op-alone ones."""
    return "back-to-back" if rows and "busbw" in rows[0][name] else "op alone"


def plot(path: str, spec: BenchSpec, nproc: int, rows: list[dict]) -> str:
    """busbw against size, one line per backend, to the PNG ``path``; its title names the mode
    (under ``--mode both`` the op-alone figures are drawn dashed beside the back-to-back ones).
    Returns the absolute path written."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install -e '.[plot]' (or pip install matplotlib)") from None
    fig, ax = plt.subplots(figsize=(7, 4))
    sizes = [r[spec.backends[0]]["size"] for r in rows]
    mode = plot_mode(rows, spec.backends[0])
    both = mode == "back-to-back" and bool(rows) and "alone" in rows[0][spec.backends[0]]
    for name in spec.backends:
        pick = (lambda r: r[name]["busbw"]) if mode == "back-to-back" else (lambda r: r[name]["alone"]["busbw"])
        line, = ax.plot(sizes, [pick(r) for r in rows], marker="o", label=f"{name} ({mode})")
        if both:
            ax.plot(sizes, [r[name]["alone"]["busbw"] for r in rows], marker="x", linestyle="--",
                    color=line.get_color(), label=f"{name} (op alone)")
    if spec.physical:
        ax.plot(sizes, [r["ceiling"] for r in rows], linestyle="--", color="grey", label="TCP ring ceiling")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("size (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(plot_title(spec, nproc, mode, both))
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return os.path.abspath(path)


def plot_title(spec: BenchSpec, nproc: int, mode: str, both: bool) -> str:
    shown = "back-to-back (solid) and op alone (dashed)" if both else mode
    return f"{spec.collective}, {nproc} ranks, {spec.dtype}: {shown}"
