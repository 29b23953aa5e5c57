"""Validating the simulator against measured runs on one host (issue 32.4).

``python -m commrt.plan.simulate_fit BENCH.json...`` reads ``commrt bench --algo ... --json``
files (one world size each, every rank on loopback), fits the model's loopback latency and
bandwidth to the 2-rank ring all_reduce rows only, then predicts every other row (each
algorithm, size and world size) with ``plan.simulate`` and prints measured against predicted.

The fit: at two ranks nothing contends, so the replayed time of a schedule is linear in the two
parameters, ``t = alpha * A + B / beta``, where ``A`` is the replay with a 1 s latency and
infinite bandwidth and ``B`` the replay with no latency and 1 B/s. Least squares on the
relative error (each row divided by its measured time) so 4 KiB rows count as much as 16 MiB.

``--cpu`` adds a compute-only figure per row: the CPU seconds all ranks spend running the same
executor (collectives/scheduled.py, ops.py) over in-memory queues instead of sockets, divided by
the cores this process may use: the floor a CPU-bound host puts under the measured time, which
the network model does not know about.

``--cores N`` fits the model with its CPU term instead (``plan/fit_cpu.py``: a message's CPU
each side, the reduction, N cores shared by the ranks) to every row of the given files, the
median of the repetitions of each row; ``--check`` files are then predicted, not fitted (another
run), and ``--emulated`` files (``commrt launch --nnodes N -n G --emulate-network RATE``: give
``--per-node G --mbit RATE``) with the same figures and the node links at the shaped rate.
``--sharing fair`` replays the links max-min fair instead of first come, first served
(``Network.sharing``); the fitted figures come out the same on loopback, where a rank's port
carries one message at a time.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import threading
import time
from collections import defaultdict
from typing import NamedTuple

import numpy as np
import torch

from commrt.collectives import ops
from commrt.collectives.reduce_ops import ReduceOp
from commrt.collectives.selection import choose, table_from
from commrt.plan import fit_cpu
from commrt.plan.network import SHARING, Network
from commrt.plan.simulate import simulate


class Row(NamedTuple):
    collective: str
    algorithm: str
    world: int
    nbytes: int
    seconds: float
    warmup: int = 0
    iters: int = 0
    alone: bool = False  # ``--mode alone``: one op after a barrier, not one of a loop


def measured(paths: list[str]) -> list[Row]:
    """Every ``zmq:ALGO`` column of every row of the bench JSON files: its back-to-back time and,
    where it was measured (``--mode alone|both``), its time alone."""
    rows = []
    for path in paths:
        doc = _collective_doc(path)
        for row in doc["rows"]:
            for name in doc["backends"]:
                algo = name.split("+")[0].partition(":")[2]
                if not algo:
                    continue
                case = (doc["collective"], algo, doc["nproc"], row[name]["size"])
                if "time_us" in row[name]:
                    rows.append(Row(*case, row[name]["time_us"] * 1e-6, doc.get("warmup", 0), doc.get("iters", 0)))
                if "alone" in row[name]:
                    rows.append(Row(*case, row[name]["alone"]["time_us"] * 1e-6, alone=True))
    return rows


def _collective_doc(path: str) -> dict:
    """The bench JSON at ``path``, refused in one line (SystemExit) unless it is a collective
    benchmark's: a ``commrt bench p2p`` or ``bench ps`` file has neither a collective nor
    ``zmq:ALGO`` columns (ps's had no "backends": a KeyError traceback; p2p's read as no rows,
    and the fit then asked for ring rows the file was never going to have)."""
    try:
        with open(path) as fh:
            doc = json.load(fh)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"simulate_fit: {path}: {exc}") from None
    kind = doc.get("benchmark") if isinstance(doc, dict) else None
    if kind or not isinstance(doc, dict) or not {"collective", "backends", "rows"} <= doc.keys():
        what = f"a 'commrt bench {kind}' file" if kind else "not a 'commrt bench COLLECTIVE --json' file"
        raise SystemExit(f"simulate_fit: {path} is {what}; it fits collective runs only "
                         "(commrt bench all_reduce --algo ring,... --json FILE)")
    return doc


def medians(rows: list[Row], per_node: int = 0, nic_bps: float = 0.0) -> dict[fit_cpu.Case, list[float]]:
    """Each measured case and its repetitions' seconds (several files of one configuration). An
    emulated row is replayed as its benchmark's loop (its link's token bucket depends on it), an
    op measured alone as one op from a synchronised start."""
    out: dict = defaultdict(list)
    for r in rows:
        loop = (r.warmup, r.iters) if nic_bps and not r.alone else (0, 0)
        out[fit_cpu.Case(r.collective, r.algorithm, r.world, r.nbytes, per_node, nic_bps, *loop, r.alone)].append(r.seconds)
    return dict(out)


def compare_cpu(groups: dict, p: fit_cpu.Params, label: str) -> list[dict]:
    out = []
    for case in sorted(groups):
        reps = groups[case]
        med, pred = statistics.median(reps), fit_cpu.predict(p, case)
        out.append({"set": label + (" alone" if case.alone else ""), "collective": case.collective, "algorithm": case.algorithm, "ranks": case.world,
                    "per_node": case.per_node or case.world, "bytes": case.nbytes, "measured_us": med * 1e6,
                    "spread_us": [min(reps) * 1e6, max(reps) * 1e6], "repetitions": len(reps),
                    "predicted_us": pred * 1e6, "error": pred / med - 1})
    return out


def markdown_cpu(entries: list[dict], p: fit_cpu.Params) -> str:
    lines = [f"Fitted on the 'fit' rows: {p.describe()}", "",
             "| set | algorithm | ranks | bytes | measured us (median; min-max) | predicted us | error |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for e in entries:
        ranks = f"{e['ranks'] // e['per_node']}x{e['per_node']}" if e["per_node"] < e["ranks"] else str(e["ranks"])
        flag = " **" if abs(e["error"]) > 0.15 else ""
        lo, hi = e["spread_us"]
        lines.append(f"| {e['set']} | {e['algorithm']} | {ranks} | {e['bytes']} | {e['measured_us']:.0f} ({lo:.0f}-{hi:.0f}) "
                     f"| {e['predicted_us']:.0f} | {e['error'] * 100:+.0f}%{flag} |")
    lines.append("")
    for label in dict.fromkeys(e["set"] for e in entries):
        mine = [e for e in entries if e["set"] == label]
        within = sum(abs(e["error"]) <= 0.15 for e in mine)
        med = statistics.median(abs(e["error"]) for e in mine) * 100
        lines.append(f"{label}: {within} of {len(mine)} rows within 15% (median |error| {med:.0f}%; ** marks the others)")
    return "\n".join(lines)


def run_cpu(args) -> tuple[list[dict], fit_cpu.Params]:
    """``--cores``: fit the CPU model on the positional files, predict the --check and --emulated ones."""
    fit_rows = medians(measured(args.json))
    cases = sorted(fit_rows)
    if len(cases) < 5:  # fit_cpu.fit's ValueError was a traceback
        raise SystemExit(f"simulate_fit --cores: fitting its 5 figures needs >= 5 measured cases (zmq:ALGO columns x "
                         f"sizes x world sizes) in the positional files, got {len(cases)} (commrt bench all_reduce "
                         "--algo all --json FILE, at two world sizes)")
    p = fit_cpu.fit(cases, [statistics.median(fit_rows[c]) for c in cases], cores=args.cores, sharing=args.sharing)
    entries = compare_cpu(fit_rows, p, "fit")
    if args.check:
        entries += compare_cpu(medians(measured(args.check)), p, "check")
    if args.emulated:
        if args.per_node < 1 or not args.mbit > 0:
            raise SystemExit("simulate_fit: --emulated needs --per-node G and --mbit RATE (the launch's -n and link)")
        entries += compare_cpu(medians(measured(args.emulated), args.per_node, args.mbit * 1e6), p, "emulated")
    return entries, p


def _net(world: int, alpha: float, beta: float) -> Network:
    return Network(world=world, per_node=world, intra_latency=alpha, intra_bw=beta)


def fit(rows: list[Row]) -> tuple[float, float]:
    """(alpha seconds, beta bytes/s) from the 2-rank ring all_reduce rows."""
    ring = [r for r in rows if (r.collective, r.algorithm, r.world) == ("all_reduce", "ring", 2)]
    if len(ring) < 2:
        raise SystemExit("simulate_fit: needs >= 2 sizes of the 2-rank ring all_reduce (commrt bench all_reduce "
                         "--nproc 2 --algo ring --json ...)")
    a = np.array([[simulate(_net(2, 1.0, 1e30), "all_reduce", "ring", r.nbytes).seconds,
                   simulate(_net(2, 0.0, 1.0), "all_reduce", "ring", r.nbytes).seconds] for r in ring])
    t = np.array([r.seconds for r in ring])
    (alpha, inv_beta), *_ = np.linalg.lstsq(a / t[:, None], np.ones(len(t)), rcond=None)
    return max(alpha, 0.0), 1.0 / max(inv_beta, 1e-15)


class _MemCtx:
    """What ops.py needs of an OpContext, over in-memory queues (no sockets, no headers)."""

    def __init__(self, rank, n, table, wires):
        self.rank, self.size, self.table, self.wires = rank, n, table, wires
        self.dtype, self.itemsize, self.piece_elems = torch.float32, 4, (4 << 20) // 4

    def algorithm(self, collective, nbytes):
        return choose(collective, nbytes, self.size, self.table)

    def send(self, dst, data=None):
        self.wires[self.rank, dst].put(b"" if data is None or not data.numel() else data.numpy().tobytes())

    def recv(self, src, numel=0):
        payload = self.wires[src, self.rank].get(timeout=60)
        return torch.frombuffer(bytearray(payload), dtype=torch.float32) if numel else torch.empty(0)

    def flush(self):
        pass


def cpu_floor(row: Row, iters: int = 5) -> float:
    """Seconds per op if the host's cores did nothing but every rank's work for ``row`` (threads
    in one process: their CPU time summed, over the cores this process may use)."""
    n, numel = row.world, max(1, row.nbytes // 4)
    wires = {(a, b): queue.Queue() for a in range(n) for b in range(n)}
    table = table_from({row.collective: row.algorithm})

    def rank(r):
        ctx, t = _MemCtx(r, n, table, wires), torch.ones(numel)
        for _ in range(iters):
            if row.collective == "all_reduce":
                ops.all_reduce(ctx, t, ReduceOp.SUM)
            elif row.collective == "broadcast":
                ops.broadcast(ctx, t, 0)
            elif row.collective == "all_gather":
                ops.all_gather(ctx, t, t[r * (numel // n):(r + 1) * (numel // n)].clone())
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    start = time.process_time()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return (time.process_time() - start) / iters / len(os.sched_getaffinity(0))


def compare(rows: list[Row], alpha: float, beta: float, cpu: bool) -> list[dict]:
    out = []
    for r in rows:
        pred = simulate(_net(r.world, alpha, beta), r.collective, r.algorithm, r.nbytes).seconds
        entry = {"collective": r.collective, "algorithm": r.algorithm, "ranks": r.world, "bytes": r.nbytes,
                 "measured_us": r.seconds * 1e6, "predicted_us": pred * 1e6, "error": pred / r.seconds - 1}
        if cpu and r.collective in ("all_reduce", "broadcast", "all_gather"):
            entry["cpu_floor_us"] = cpu_floor(r) * 1e6
        out.append(entry)
    return out


def markdown(entries: list[dict], alpha: float, beta: float) -> str:
    lines = [f"Fitted on the 2-rank ring: alpha = {alpha * 1e6:.1f} us, beta = {beta / 1e9:.3f} GB/s", "",
             "| collective | algorithm | ranks | bytes | measured us | predicted us | error | cpu floor us |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for e in entries:
        floor = f"{e['cpu_floor_us']:.0f}" if "cpu_floor_us" in e else "-"
        flag = " **" if abs(e["error"]) > 0.15 else ""
        lines.append(f"| {e['collective']} | {e['algorithm']} | {e['ranks']} | {e['bytes']} | {e['measured_us']:.0f} | "
                     f"{e['predicted_us']:.0f} | {e['error'] * 100:+.0f}%{flag} | {floor} |")
    within = sum(abs(e["error"]) <= 0.15 for e in entries)
    lines += ["", f"{within} of {len(entries)} rows within 15% (** marks the others)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m commrt.plan.simulate_fit", description=__doc__.split("\n\n")[0])
    ap.add_argument("json", nargs="+", help="commrt bench --algo ... --json files")
    ap.add_argument("--cpu", action="store_true", help="add the compute-only floor per row")
    ap.add_argument("--out", help="also write the comparison as JSON here")
    ap.add_argument("--cores", type=int, default=0, help="fit the model with its CPU term, N cores shared by the ranks")
    ap.add_argument("--check", nargs="*", default=[], help="with --cores: loopback files predicted, not fitted")
    ap.add_argument("--emulated", nargs="*", default=[], help="with --cores: emulated-cluster files predicted")
    ap.add_argument("--per-node", type=int, default=0, help="ranks per node of the --emulated runs")
    ap.add_argument("--mbit", type=float, default=0.0, help="the --emulated runs' link rate, Mbit/s")
    ap.add_argument("--sharing", choices=SHARING, default="fcfs",
                    help="with --cores: how a link serves concurrent messages (first come first served, or max-min fair)")
    args = ap.parse_args(argv)
    if args.cores < 0:  # a ConfigError traceback from the first replay of the fit
        ap.error(f"--cores {args.cores}: cores shared by the ranks, >= 1 (0: the network-only fit)")
    if args.cores:
        entries, p = run_cpu(args)
        print(markdown_cpu(entries, p))
        if args.out:
            with open(args.out, "w") as fh:
                json.dump({"params": p._asdict(), "rows": entries}, fh, indent=1)
        return 0
    rows = sorted(measured(args.json), key=lambda r: (r.collective, r.algorithm, r.world, r.nbytes))
    alpha, beta = fit(rows)
    entries = compare(rows, alpha, beta, args.cpu)
    print(markdown(entries, alpha, beta))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"alpha_s": alpha, "beta_Bps": beta, "rows": entries}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
