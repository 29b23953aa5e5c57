"""``commrt estimate``: options -> ``estimate.Job`` / ``Cluster``, a comparison table or JSON.

Several configurations: each ``--compare 'stage=3,hpz=8'`` is the base options with those
changed (option names without the dashes; ``quant-weights=none`` turns one off); the table gets
one column per configuration.

``--measure`` replaces the bandwidths with measured ones. Run inside a launched job (``commrt
launch``, torchrun: WORLD_SIZE > 1), every rank joins and times an all_reduce over its node and
across nodes (``train.groups.measure_levels``, the probe auto sharding uses; the slowest rank's
time): ``--intra-bw`` = the node group's busbw (bytes a rank sends per second inside its node),
``--inter-bw`` = the cross-node group's busbw x ranks per node (all local ranks cross at once,
through the node's one link, which is what the model's inter-bw is); rank 0 prints. A level the
job does not have (one node, one rank per node) keeps the given figure, and the output says so.
Outside a job, only ``--intra-bw`` is measured, by a 2-rank ``commrt bench sendrecv`` on this host.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from typing import TYPE_CHECKING, NamedTuple

from commrt.plan import simulate_command
from commrt.runtime.errors import CommError, ConfigError

if TYPE_CHECKING:  # the model imports torch: only once the command runs, not for every commrt command
    from commrt.plan.estimate import Cluster, Estimate, Job

_BW_UNITS = {"b/s": 1, "kb/s": 1e3, "mb/s": 1e6, "gb/s": 1e9, "tb/s": 1e12,
             "bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "tbit": 1e12 / 8}
_JOB_KEYS = {"params", "stage", "strategy", "hpz", "shard_group_size", "quant_weights", "quant_grads", "dtype",
             "optimizer", "bucket", "pipeline", "microbatches", "hidden", "seq", "micro_batch"}
_CLUSTER_KEYS = {"nodes", "per_node", "intra_bw", "inter_bw", "hierarchical"}


def parse_bandwidth(text: str) -> float:
    """'100GB/s' -> 1e11 bytes/s; '100gbit' -> 1.25e10; a plain number is bytes/s."""
    m = re.fullmatch(r"\s*([\d.]+(?:e\d+)?)\s*([a-zA-Z/]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or (unit and unit not in _BW_UNITS):
        raise ConfigError(f"cannot read bandwidth {text!r}; use e.g. 100GB/s, 12.5GB/s, 100gbit")
    try:  # the pattern lets '.' and '1.2.3' through, and '1e999' is inf (Infinity in --json: not JSON)
        value = float(m.group(1)) * (_BW_UNITS[unit] if unit else 1)
    except ValueError:
        value = math.inf
    if not math.isfinite(value):
        raise ConfigError(f"cannot read bandwidth {text!r}; use e.g. 100GB/s, 12.5GB/s, 100gbit")
    return value


def add_parser(sub) -> argparse.ArgumentParser:
    ep = sub.add_parser("estimate", help="predict memory, bytes and communication time per rank and step",
                        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ep.add_argument("--params", type=float, help="trainable parameters (7e9); required unless --simulate")
    ep.add_argument("--nodes", type=int, default=1)
    ep.add_argument("--per-node", type=int, default=1, help="ranks per node")
    ep.add_argument("--stage", type=int, help="ZeRO stage 0-3")
    ep.add_argument("--strategy", help="FULL_SHARD | SHARD_GRAD_OP | NO_SHARD | HYBRID_SHARD | _HYBRID_SHARD_ZERO2")
    ep.add_argument("--shard-group-size", type=int, default=0, help="hybrid: ranks per shard group (0: a node)")
    ep.add_argument("--hpz", type=int, default=1, help="ZeRO++ hpZ secondary group size (stage 3)")
    ep.add_argument("--quant-weights", choices=["int8", "int4"], help="qwZ: stage-3 gathers quantized")
    ep.add_argument("--quant-grads", choices=["int8", "int4"], help="qgZ: gradient reductions quantized")
    ep.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ep.add_argument("--optimizer", default="adamw", choices=["adamw", "lamb", "sgd", "sgd-no-momentum"])
    ep.add_argument("--bucket", type=float, default=6_553_600,  # the engine's default (train/config.py)
                    help="elements per unit (reduce_bucket_size)")
    ep.add_argument("--pipeline", type=int, default=1, help="pipeline stages (blocks of consecutive ranks)")
    ep.add_argument("--microbatches", type=int, default=1)
    ep.add_argument("--hidden", type=int, default=0, help="pipeline: hidden size of the activations sent")
    ep.add_argument("--seq", type=int, default=0, help="pipeline: sequence length")
    ep.add_argument("--micro-batch", type=int, default=1, help="pipeline: sequences per micro-batch")
    ep.add_argument("--intra-bw", default="100GB/s", help="per rank, inside a node")
    ep.add_argument("--inter-bw", default="12.5GB/s", help="per node, to the other nodes")
    ep.add_argument("--hierarchical", default="auto", choices=["auto", "always", "never"])
    ep.add_argument("--compare", action="append", default=[], metavar="KEY=VAL[,KEY=VAL]",
                    help="another configuration: the options above with these changed (repeatable)")
    ep.add_argument("--measure", action="store_true",
                    help="measure the bandwidths: inside a launched job, over its nodes' links; else --intra-bw "
                         "with 2 local ranks")
    ep.add_argument("--measure-bytes", default="16M", help="--measure: the probe's all_reduce size")
    ep.add_argument("--json", action="store_true", help="print JSON instead of the table")
    simulate_command.add_arguments(ep)
    return ep


def _configs(args) -> list[tuple[str, "Job", "Cluster"]]:
    from commrt.plan.estimate import Cluster, Job
    base = {k: getattr(args, k) for k in _JOB_KEYS | _CLUSTER_KEYS}
    out = []
    for label in ["base", *args.compare]:
        cfg = dict(base)
        for item in ([] if label == "base" else label.split(",")):
            key, sep, value = item.partition("=")
            key = key.strip().replace("-", "_")
            if not sep or key not in cfg:
                raise ConfigError(f"--compare {label!r}: {item!r} is not KEY=VALUE with KEY among "
                                  f"{sorted(k.replace('_', '-') for k in cfg)}")
            cfg[key] = _typed(key, value.strip(), base[key])
        job = Job(**{k: cfg[k] for k in _JOB_KEYS if k not in ("params", "bucket")},
                  params=_count("params", cfg["params"]), bucket=_count("bucket", cfg["bucket"]))
        cluster = Cluster(nodes=cfg["nodes"], per_node=cfg["per_node"], intra_bw=parse_bandwidth(cfg["intra_bw"]),
                          inter_bw=parse_bandwidth(cfg["inter_bw"]), hierarchical=cfg["hierarchical"])
        out.append((label, job, cluster))
    return out


MAX_COUNT = 10**15
"""The most parameters (and elements per bucket) the model takes: a million times today's
largest models; beyond it the list of buckets would not fit in memory."""


def _count(key: str, value: float | None) -> int | None:
    """--params / --bucket (read as floats: 7e9) as an int; nan, inf and absurd sizes refused."""
    if value is None:
        return None
    if not 0 <= value <= MAX_COUNT:  # nan fails both comparisons
        raise ConfigError(f"--{key} = {value} is invalid; valid: 1 to {MAX_COUNT:.0e}")
    return int(value)


def _typed(key: str, value: str, like):
    if value.lower() == "none":
        return None
    try:
        if key in ("params", "bucket"):
            return float(value)
        if isinstance(like, int) or key == "stage":
            return int(value)
    except ValueError:
        raise ConfigError(f"--compare {key.replace('_', '-')}={value!r}: not a number") from None
    return value


class Measured(NamedTuple):
    intra_bw: str
    inter_bw: str
    note: str
    prints: bool = True  # False on the ranks of a job other than rank 0


PROBE_TIMEOUT_S = 300.0  # the probe's whole run, start-up included (about 20 s on a quiet host)
PROBE_STOP_S = 30.0      # after SIGTERM, for the probe's launcher to stop its ranks


def probe_command(path: str) -> list[str]:
    """The probe: a 2-rank 16 MiB ``commrt bench sendrecv`` writing its JSON to ``path``."""
    return [sys.executable, "-m", "commrt.cli", "bench", "sendrecv", "--nproc", "2", "-b", "16M", "-e", "16M",
            "-n", "10", "-w", "3", "--json", path]


def measure_intra_bw() -> float:
    """Point-to-point bytes/s between two local ranks (a 16 MiB commrt bench sendrecv). A probe
    past PROBE_TIMEOUT_S is a CommError in one line, not subprocess's TimeoutExpired traceback;
    it is stopped with SIGTERM first, on which its launcher stops the ranks it started (the
    SIGKILL subprocess.run sends left them running)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.json")
        cmd = probe_command(path)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            _, err = proc.communicate(timeout=PROBE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _stop(proc)
            raise CommError(f"--measure: the bench probe (a 2-rank commrt bench sendrecv) did not finish within "
                            f"{PROBE_TIMEOUT_S:g} s and was stopped; give --intra-bw without --measure instead") from None
        if proc.returncode != 0 or not os.path.exists(path):
            raise ConfigError(f"--measure: the bench probe failed: {err[-2000:]}")
        with open(path) as fh:
            return float(json.load(fh)["avg_busbw"]["zmq"]) * 1e9


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.communicate(timeout=PROBE_STOP_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()


def in_job() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1") or 1) > 1


def bandwidths(found: dict[str, float], per_node: int, given: tuple[str, str]) -> tuple[str, str, list[str]]:
    """The model's (intra_bw, inter_bw) from ``measure_levels``' busbw per level: the node
    link carries every local rank's cross-node bytes at once, so inter = busbw x per_node.
    A level not measured keeps its given figure; the lines say which is which."""
    intra, inter = given
    lines = []
    if "intra" in found:
        intra = str(found["intra"])
        lines.append(f"inside a node {found['intra'] / 1e9:.3f} GB/s per rank (all_reduce busbw): measured")
    else:
        lines.append(f"inside a node {intra}: as given (one rank per node: nothing to measure)")
    if "inter" in found:
        inter = str(found["inter"] * per_node)
        lines.append(f"across nodes {found['inter'] * per_node / 1e9:.3f} GB/s per node ({per_node} ranks x "
                     f"{found['inter'] / 1e9:.3f} GB/s all_reduce busbw at once): measured")
    else:
        lines.append(f"across nodes {inter}: as given (one node: nothing to measure)")
    return intra, inter, lines


def measure(args) -> Measured:
    nbytes = parse_size(args.measure_bytes)
    if not in_job():
        intra = measure_intra_bw()
        return Measured(str(intra), args.inter_bw,
                        f"# measured inside the node: {intra / 1e9:.2f} GB/s per rank (commrt bench sendrecv, "
                        f"2 ranks here); across nodes as given: {args.inter_bw} (not measured outside a job: "
                        f"run --measure under commrt launch --nnodes K to measure the links between nodes)")
    from commrt import distributed
    from commrt.topology import mesh
    from commrt.train import groups
    distributed.init_process_group()
    try:
        found = groups.measure_levels(nbytes, rounds=3)
        nodes, per_node = mesh.get_num_nodes(), mesh.get_local_world_size()
        rank0 = distributed.get_rank() == 0
    finally:
        distributed.destroy_process_group()
    intra, inter, lines = bandwidths(found, per_node, (args.intra_bw, args.inter_bw))
    head = f"# measured on this job ({nodes} nodes x {per_node} ranks, a {nbytes} B all_reduce, slowest rank):"
    return Measured(intra, inter, "\n# ".join([head, *lines]), rank0)


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)i?[bB]?\s*", str(text))
    if m is None:
        raise ConfigError(f"cannot read size {text!r}; use e.g. 4M, 16MiB, 65536")
    return int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[m.group(2).lower()]


class Output(NamedTuple):
    text: str            # the table or JSON, for stdout
    note: str | None     # what --measure measured, for stderr


def render(args) -> Output | None:
    """The estimate for ``args``; None on a job's ranks other than 0 (``--measure`` in a job).
    The CLI prints it (commrt/cli.py)."""
    if args.simulate:
        return Output(simulate_command.render(args, parse_size, parse_bandwidth), None)
    if args.params is None:
        raise ConfigError("commrt estimate needs --params (or --simulate)")
    from commrt.plan.estimate import estimate
    measured = None
    if args.measure:
        measured = measure(args)
        args.intra_bw, args.inter_bw = measured.intra_bw, measured.inter_bw
        if not measured.prints:
            return None
    results = [(label, job, cluster, estimate(job, cluster)) for label, job, cluster in _configs(args)]
    if args.json:
        text = json.dumps([{"config": label, "job": dataclasses.asdict(job), "cluster": dataclasses.asdict(cluster),
                            **({"measured": measured.note} if measured else {}), **to_dict(est)}
                           for label, job, cluster, est in results], indent=1)
    else:
        text = table([(label, est) for label, _, _, est in results])
    return Output(text, measured.note if measured else None)


def to_dict(est: Estimate) -> dict:
    return {"plan": est.plan._asdict(), "memory": est.memory,
            "bytes": {k: {"intra_node": a, "inter_node": b} for k, (a, b) in est.phases.items()},
            "by_op": {k: {"intra_node": a, "inter_node": b} for k, (a, b) in est.by_op.items()},
            "seconds": est.seconds}


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def table(results: list[tuple[str, Estimate]]) -> str:
    """Rows of quantities, one column per configuration."""
    phases = list(dict.fromkeys(k for _, e in results for k in e.phases))
    rows: list[tuple[str, list[str]]] = [("plan (stage/shard/replicas/hpZ)", [
        f"{e.plan.stage}/{e.plan.shard}/{e.plan.replicas}/{e.plan.secondary or '-'}" for _, e in results])]
    rows.append(("memory per rank", [""] * len(results)))
    for key in ("parameters", "gradients", "optimizer_state", "total"):
        rows.append((f"  {key.replace('_', ' ')}", [_size(e.memory[key]) for _, e in results]))
    rows.append(("sent per step: in node / across", [""] * len(results)))
    for ph in phases + ["total"]:
        vals = [(sum(a for a, _ in e.phases.values()), sum(b for _, b in e.phases.values())) if ph == "total"
                else e.phases.get(ph) for _, e in results]
        rows.append((f"  {ph}", [f"{_size(v[0])} / {_size(v[1])}" if v else "-" for v in vals]))
    rows.append(("comm time per step", [""] * len(results)))
    for ph in phases + ["total"]:
        rows.append((f"  {ph}", [f"{1e3 * e.seconds[ph]:.1f} ms" if ph in e.seconds else "-" for _, e in results]))
    head = ("", [label for label, _ in results])
    width = max(len(name) for name, _ in [head, *rows])
    cols = [max(len(r[1][i]) for r in [head, *rows]) for i in range(len(results))]
    return "\n".join((f"{name:<{width}}  " + "  ".join(f"{v:>{w}}" for v, w in zip(vals, cols))).rstrip()
                     for name, vals in [head, *rows])
