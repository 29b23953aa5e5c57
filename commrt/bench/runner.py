"""What each rank does in ``commrt bench``: set up every requested backend side by side,
then for each size measure each backend in turn (interleaved, because this machine is noisy)
and check the results of every size against a locally computed reference."""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable

import torch

from .. import bootstrap, mesh, rendezvous, stats
from ..transport.hub import Transport
from ..collectives.reduce_ops import ReduceOp, parse_op
from ..config import load_config
from ..dtypes import parse_dtype
from . import metrics, physical


@dataclasses.dataclass(frozen=True)
class BenchSpec:
    collective: str
    backends: tuple[str, ...]
    min_bytes: int
    max_bytes: int
    factor: float
    iters: int
    warmup: int
    dtype: str
    op: str
    physical: bool = False


def pattern(numel: int, rank: int, dtype: torch.dtype, op: ReduceOp) -> torch.Tensor:
    """Small integers, so that sums and products are exact in every dtype we support."""
    i = torch.arange(numel, dtype=torch.int64)
    if op == ReduceOp.PRODUCT:
        v = 1 + ((i + rank) % 3 == 0).long()
    else:
        v = (i * 7 + rank * 13) % 17 - 8
        if dtype == torch.uint8:
            v = v.abs()
    return v.to(dtype)


def reference(parts: list[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    """Single-process reduction of every rank's tensor, in rank order (the oracle)."""
    wide = [p.double() if p.is_floating_point() else p.long() for p in parts]
    acc = wide[0].clone()
    for p in wide[1:]:
        if op in (ReduceOp.SUM, ReduceOp.AVG):
            acc += p
        elif op == ReduceOp.PRODUCT:
            acc *= p
        elif op == ReduceOp.MAX:
            acc = torch.maximum(acc, p)
        else:
            acc = torch.minimum(acc, p)
    if op == ReduceOp.AVG:
        acc = acc / len(parts) if acc.is_floating_point() else torch.div(acc, len(parts), rounding_mode="floor")
    return acc.to(parts[0].dtype)


@dataclasses.dataclass
class Case:
    """Buffers and closures for one (collective, size) on one rank."""
    run: Callable[[], None]
    reset: Callable[[], None]
    check: Callable[[], torch.Tensor]  # the tensor to compare
    expected: torch.Tensor
    count: int
    nbytes: int


def device_of(be) -> torch.device:
    """Where a backend's tensors live: NCCL works on this rank's GPU, the others on the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if be.name == "nccl" else torch.device("cpu")


def make_case(coll: str, be, nbytes: int, dtype: torch.dtype, op: ReduceOp) -> Case:
    n, r = be.size, be.rank
    item = dtype.itemsize
    count = max(1, nbytes // item)
    if coll in ("reduce_scatter", "all_gather", "all_to_all"):
        count = max(n, count // n * n)
    m = count // n
    dev = device_of(be)
    cpu_pats = [pattern(count, k, dtype, op) for k in range(n)]
    pats = [p.to(dev) for p in cpu_pats]
    if coll == "all_reduce":
        buf = pats[r].clone()
        return Case(lambda: be.all_reduce(buf, op, False), lambda: buf.copy_(pats[r]), lambda: buf,
                    reference(cpu_pats, op), count, count * item)
    if coll == "reduce_scatter":
        out = torch.empty(m, dtype=dtype, device=dev)
        return Case(lambda: be.reduce_scatter_tensor(out, pats[r], op, False), lambda: None, lambda: out,
                    reference(cpu_pats, op)[r * m:(r + 1) * m], count, count * item)
    if coll == "all_gather":
        out = torch.empty(count, dtype=dtype, device=dev)
        mine = pats[r][:m].clone()
        return Case(lambda: be.all_gather_into_tensor(out, mine, False), lambda: None, lambda: out,
                    torch.cat([p[:m] for p in cpu_pats]), count, count * item)
    if coll == "broadcast":
        buf = pats[r].clone()
        return Case(lambda: be.broadcast(buf, 0, False), lambda: buf.copy_(pats[r]), lambda: buf,
                    cpu_pats[0], count, count * item)
    if coll == "reduce":
        buf = pats[r].clone()
        exp = reference(cpu_pats, op) if r == 0 else cpu_pats[r]
        return Case(lambda: be.reduce(buf, 0, op, False), lambda: buf.copy_(pats[r]), lambda: buf,
                    exp, count, count * item)
    if coll == "all_to_all":
        out = torch.empty(count, dtype=dtype, device=dev)
        exp = torch.cat([cpu_pats[k][r * m:(r + 1) * m] for k in range(n)])
        return Case(lambda: be.all_to_all_single(out, pats[r], None, None, False), lambda: None,
                    lambda: out, exp, count, count * item)
    if coll == "sendrecv":
        out = torch.empty(count, dtype=dtype, device=dev)
        right, left = (r + 1) % n, (r - 1) % n

        def run():
            if n == 1:
                out.copy_(pats[r])
                return
            works = [be.isend(pats[r], right, 0), be.irecv(out, left, 0)]
            for w in works:
                w.wait()
        return Case(run, lambda: None, lambda: out, cpu_pats[left], count, count * item)
    raise ValueError(f"unknown collective '{coll}'; valid: {list(metrics.COLLECTIVES)}")


def _slowest(be, seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64, device=device_of(be))
    be.all_reduce(t, ReduceOp.MAX, False)
    return float(t[0])


def measure(coll: str, be, nbytes: int, dtype: torch.dtype, op: ReduceOp, iters: int, warmup: int) -> dict:
    case = make_case(coll, be, nbytes, dtype, op)
    for _ in range(warmup):
        case.run()
    be.barrier(False)
    sync = torch.cuda.synchronize if device_of(be).type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        case.run()
    sync()  # NCCL returns before the GPU is done
    elapsed = _slowest(be, time.perf_counter() - start) / iters
    case.reset()
    case.run()
    count_wrong = getattr(be, "count_wrong", metrics.count_wrong)  # quantized: within the codec's bound
    wrong = torch.tensor([count_wrong(case.check().cpu(), case.expected)], dtype=torch.int64,
                         device=device_of(be))
    be.all_reduce(wrong, ReduceOp.SUM, False)
    alg = metrics.algbw(case.nbytes, elapsed)
    return {"size": case.nbytes, "count": case.count, "time_us": elapsed * 1e6, "algbw": alg,
            "busbw": metrics.busbw(coll, be.size, alg), "wrong": int(wrong[0])}


def node_traffic(rt) -> dict[str, int]:
    """Bytes every rank of ``rt`` sent so far to ranks on its own node and on other nodes, summed."""
    mine = stats.split_by_node(rt.transport.counters.sent_by_op(), rt.transport.counters.same_node or [])
    t = torch.tensor([mine["intra_node_bytes"], mine["inter_node_bytes"]], dtype=torch.float64,
                     device=device_of(rt.world.backend))
    rt.world.backend.all_reduce(t, ReduceOp.SUM, False)
    return {"intra_node_bytes": int(t[0]), "inter_node_bytes": int(t[1])}


def _backend(name: str, rt):
    """``NAME+hier``: the hierarchical collectives; ``NAME+int8`` / ``+int4``: the quantized ones."""
    if name.endswith("+hier"):
        return mesh.TwoLevelBackend(rt)
    if name.endswith(("+int8", "+int4")):
        from .quant import QuantBackend
        return QuantBackend(rt, name.rsplit("+", 1)[1])
    return rt.world.backend


def run(spec: BenchSpec, progress: Callable[[str], None] | None = None, environ=os.environ,
        traffic: dict | None = None) -> list[dict]:
    """Run in every rank; returns the rows (identical on every rank). ``traffic``, if given, gets
    per backend the bytes all ranks sent inside nodes and across nodes (see ``node_traffic``).
    A backend named ``<name>+hier`` is ``<name>`` with the hierarchical collectives."""
    rdzv = rendezvous.resolve("env://", None, None, environ)
    dtype, op = parse_dtype(spec.dtype), parse_op(spec.op)
    cfg = load_config()
    transport = Transport(cfg, f"rank{rdzv.rank}")
    store, server = bootstrap.open_store(transport, rdzv, cfg.comm.timeout_s)
    runtimes = {}
    try:
        for name in spec.backends:
            bcfg = dataclasses.replace(cfg, comm=dataclasses.replace(cfg.comm, backend=name.split("+")[0]))
            runtimes[name] = bootstrap.init_world(bcfg, rdzv, store=(store, None), namespace=f"{name}/")
        backends = {name: _backend(name, rt) for name, rt in runtimes.items()}
        first = runtimes[spec.backends[0]].world.backend
        ring = physical.TcpRing.open(store, rdzv.rank, rdzv.world_size, cfg.cluster.bind_host) if spec.physical else None
        rows = []
        sizes = metrics.size_series(spec.min_bytes, spec.max_bytes, spec.factor)
        for i, nbytes in enumerate(sizes):
            row = {"sizes_done": i}
            for name, rt in runtimes.items():
                if progress:
                    progress(f"[{i + 1}/{len(sizes)}] {spec.collective} {metrics.format_size(nbytes)} on {name}")
                row[name] = measure(spec.collective, backends[name], nbytes, dtype, op, spec.iters, spec.warmup)
            if ring is not None:
                row["ceiling"] = ring.measure(first, nbytes, spec.iters, spec.warmup)
            row.pop("sizes_done")
            rows.append(row)
        if ring is not None:
            ring.close()
        if traffic is not None:
            traffic.update({name: node_traffic(rt) for name, rt in runtimes.items()})
            for name, be in backends.items():
                if hasattr(be, "summary"):
                    traffic[name]["quant"] = be.summary()
        return rows
    finally:
        for rt in runtimes.values():
            bootstrap.shutdown(rt, keep_store=True)
        store.close()
        if server is not None:
            server.close()
        transport.close()
