"""``commrt estimate --simulate``: replay the collective schedules over a modelled cluster and
print each algorithm's time per size and world, the algorithm the selection table picks, and
(JSON) the messages, bytes and load per kind of link; ``--cpu-msg``, ``--cpu-byte``,
``--reduce-bw`` and ``--cores`` add the CPU term (plan/network.py). Pure: no processes, no torch."""
from __future__ import annotations

import json

from commrt.collectives.schedules import ALGORITHMS
from commrt.collectives.selection import choose
from commrt.plan.network import SHARING, Network
from commrt.plan.simulate import Result, load_by_kind, simulate
from commrt.runtime.errors import ConfigError


def add_arguments(ep) -> None:
    g = ep.add_argument_group("--simulate (issue 32.4): --nodes, --per-node, --intra-bw, --inter-bw (the NIC) apply")
    g.add_argument("--simulate", action="store_true", help="replay collective schedules over the cluster model")
    g.add_argument("--collective", default="all_reduce", choices=sorted(ALGORITHMS))
    g.add_argument("--algorithms", default="", help="comma-separated (default: every one the collective has)")
    g.add_argument("--sizes", default="4K,64K,1M,16M", help="comma-separated bytes per rank")
    g.add_argument("--worlds", default="", help="comma-separated world sizes (default: nodes x per-node)")
    g.add_argument("--intra-latency", type=float, default=2e-6, help="seconds, a message inside a node")
    g.add_argument("--inter-latency", type=float, default=5e-6, help="seconds added leaving the node")
    g.add_argument("--spine-latency", type=float, default=1e-6, help="seconds added crossing the spine")
    g.add_argument("--nodes-per-leaf", type=int, default=16)
    g.add_argument("--oversubscription", type=float, default=1.0, help="leaf down/up bandwidth ratio")
    g.add_argument("--cpu-msg", type=float, default=0.0, help="CPU seconds a message costs each side (0: no CPU term)")
    g.add_argument("--cpu-byte", type=float, default=0.0, help="CPU seconds per byte each side")
    g.add_argument("--reduce-bw", default="0", help="a rank's reduction speed, e.g. 2.4GB/s (0: free)")
    g.add_argument("--cores", type=int, default=0, help="cores per node shared by its ranks (0: one per rank)")
    g.add_argument("--sharing", choices=SHARING, default="fcfs",
                   help="how a link serves concurrent messages: fcfs (one after another) or fair (max-min shares, "
                        "as TCP; needed where an aggregate link carries several NICs' flows: the spine)")


def _list(text: str, kind, what: str) -> list:
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError as err:
        raise ConfigError(f"--{what} {text!r}: {err}") from None


def results(args, parse_size, parse_bandwidth) -> list[Result]:
    valid = ALGORITHMS[args.collective]
    algos = _list(args.algorithms, str.strip, "algorithms") or sorted(valid)
    bad = [a for a in algos if a not in valid]
    if bad:
        raise ConfigError(f"--algorithms {bad} not known for {args.collective}; valid: {sorted(valid)}")
    worlds = _list(args.worlds, int, "worlds") or [args.nodes * args.per_node]
    out = []
    for world in worlds:
        net = Network(world=world, per_node=args.per_node, intra_latency=args.intra_latency,
                      intra_bw=parse_bandwidth(args.intra_bw), nic_latency=args.inter_latency,
                      nic_bw=parse_bandwidth(args.inter_bw), nodes_per_leaf=args.nodes_per_leaf,
                      spine_latency=args.spine_latency, oversubscription=args.oversubscription,
                      cpu_msg=args.cpu_msg, cpu_byte=args.cpu_byte, cores=args.cores, sharing=args.sharing,
                      reduce_bw=parse_bandwidth(args.reduce_bw) if args.reduce_bw.strip() not in ("", "0") else 0.0)
        for size in [parse_size(s) for s in args.sizes.split(",")]:
            if size % 4:  # the replay moves float32 elements: 2 B was simulated as 0 elements
                raise ConfigError(f"--sizes {size}: bytes per rank of float32 elements, a multiple of 4")
            out += [simulate(net, args.collective, a, size) for a in algos]
    return out


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.1f}" if seconds < 1 else f"{seconds:.3f}s"


def table(res: list[Result]) -> str:
    """One row per (world, size): microseconds per algorithm, the fastest, the table's choice."""
    algos = list(dict.fromkeys(r.algorithm for r in res))
    rows = [["ranks", "bytes", *[f"{a} us" for a in algos], "fastest", "table picks"]]
    keys = list(dict.fromkeys((r.world, r.nbytes) for r in res))
    for world, nbytes in keys:
        here = {r.algorithm: r for r in res if (r.world, r.nbytes) == (world, nbytes)}
        best = min(here.values(), key=lambda r: r.seconds).algorithm
        pick = choose(res[0].collective, nbytes, world)
        rows.append([str(world), str(nbytes), *[_us(here[a].seconds) if a in here else "-" for a in algos],
                     best, pick])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows)


def to_json(res: list[Result], net_args: dict) -> str:
    return json.dumps({"network": net_args, "results": [
        {"collective": r.collective, "algorithm": r.algorithm, "world": r.world, "bytes": r.nbytes,
         "seconds": r.seconds, "messages": r.messages, "bytes_sent": r.bytes_sent, "replayed": r.replayed,
         "chosen": choose(r.collective, r.nbytes, r.world), "links": load_by_kind(r.link_bytes)}
        for r in res]}, indent=1)


def render(args, parse_size, parse_bandwidth) -> str:
    res = results(args, parse_size, parse_bandwidth)
    if args.json:
        keys = ("per_node", "intra_bw", "inter_bw", "intra_latency", "inter_latency", "spine_latency",
                "nodes_per_leaf", "oversubscription", "cpu_msg", "cpu_byte", "reduce_bw", "cores", "sharing")
        return to_json(res, {k: getattr(args, k) for k in keys})
    partial = [r for r in res if r.replayed < 1]
    note = (f"\n# {len(partial)} result(s) replayed in part (ring/pairwise: the first steps of each phase, "
            f"the rest at their steady per-step time; see commrt/plan/simulate.py)" if partial else "")
    return f"# {res[0].collective}, simulated (commrt.plan.simulate)\n" + table(res) + note
