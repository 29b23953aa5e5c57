"""What each rank does in ``commrt bench``: set up every requested backend side by side,
then for each size measure each backend in turn (interleaved, because this machine is noisy)
and check the results of every size against a locally computed reference."""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable

import numpy as np
import torch

from commrt.runtime import bootstrap, rendezvous
from commrt.topology import dispatch
from commrt.obs import stats
from commrt.transport.transport import Transport
from commrt.collectives.reduce_ops import ReduceOp, parse_op
from commrt.runtime.config import load_config
from commrt.runtime.dtypes import parse_dtype
from commrt.bench import alone, metrics, physical


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
    mode: str = "back-to-back"
    """both | back-to-back | alone (bench/alone.py): how each op is timed."""
    input: str = "torch"
    """torch | numpy: the type of the buffers handed to the collectives."""
    device: str = "cpu"
    """cpu | cuda: where the non-NCCL backends' tensors live (NCCL's are always on the GPU);
    cuda puts every backend, and the quantized columns' codec, on this rank's GPU."""


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
    refill: Callable[[], None] = lambda: None  # rewrite the input, as a new step's gradients


def _refiller(dst: torch.Tensor, src: torch.Tensor, as_numpy: bool) -> Callable[[], None]:
    """dst[:] = src, the way the program would write it: numpy for numpy input (one thread),
    torch's copy for tensors (which may use its intra-op threads, as a training step does)."""
    if as_numpy:
        d, s = dst.numpy(), src.numpy()
        return lambda: np.copyto(d, s)
    return lambda: dst.copy_(src)


_DEVICE = {"all": "cpu"}
"""``BenchSpec.device`` of this rank's run (set once by ``run``: one spec a process), so the
helpers below that take only a backend know it."""


def device_of(be) -> torch.device:
    """Where a backend's tensors live: NCCL works on this rank's GPU; the others on the CPU, or
    on the GPU too with ``--device cuda`` (zmq / gloo then stage them through host memory)."""
    if be.name == "nccl" or _DEVICE["all"] == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def make_case(coll: str, be, nbytes: int, dtype: torch.dtype, op: ReduceOp, as_numpy: bool = False) -> Case:
    """``as_numpy``: the collective gets numpy views of the buffers (the public API takes both)."""
    n, r = be.size, be.rank
    item = dtype.itemsize
    count = max(1, nbytes // item)
    if coll in ("reduce_scatter", "all_gather", "all_to_all"):
        count = max(n, count // n * n)
    m = count // n
    dev = device_of(be)
    if as_numpy and (dev.type != "cpu" or dtype == torch.bfloat16):
        raise ValueError(f"--input numpy needs a CPU backend and a numpy dtype, not {be.name} / {dtype}")
    arg = (lambda t: t.numpy()) if as_numpy else (lambda t: t)
    cpu_pats = [pattern(count, k, dtype, op) for k in range(n)]
    pats = [p.to(dev) for p in cpu_pats]
    mine = pats[r].clone()  # the input the op reads; pats[r] stays the source of each refill
    refill = _refiller(mine, pats[r], as_numpy)
    size = count * item
    if coll in ("all_reduce", "broadcast", "reduce"):
        exp = {"all_reduce": reference(cpu_pats, op), "broadcast": cpu_pats[0],
               "reduce": reference(cpu_pats, op) if r == 0 else cpu_pats[r]}[coll]
        x = arg(mine)
        run = {"all_reduce": lambda: be.all_reduce(x, op, False), "broadcast": lambda: be.broadcast(x, 0, False),
               "reduce": lambda: be.reduce(x, 0, op, False)}[coll]
        return Case(run, refill, lambda: mine, exp, count, size, refill)
    if coll == "sendrecv":
        return _sendrecv_case(be, pats, cpu_pats, mine, refill, arg, count, size)
    out = torch.empty(m if coll == "reduce_scatter" else count, dtype=dtype, device=dev)
    o, x = arg(out), arg(mine)
    if coll == "reduce_scatter":
        return Case(lambda: be.reduce_scatter_tensor(o, x, op, False), lambda: None, lambda: out,
                    reference(cpu_pats, op)[r * m:(r + 1) * m], count, size, refill)
    if coll == "all_gather":
        part = mine[:m]
        p = arg(part)
        return Case(lambda: be.all_gather_into_tensor(o, p, False), lambda: None, lambda: out,
                    torch.cat([q[:m] for q in cpu_pats]), count, size, _refiller(part, pats[r][:m], as_numpy))
    if coll == "all_to_all":
        exp = torch.cat([cpu_pats[k][r * m:(r + 1) * m] for k in range(n)])
        return Case(lambda: be.all_to_all_single(o, x, None, None, False), lambda: None,
                    lambda: out, exp, count, size, refill)
    raise ValueError(f"unknown collective '{coll}'; valid: {list(metrics.COLLECTIVES)}")


def _sendrecv_case(be, pats, cpu_pats, mine, refill, arg, count: int, size: int) -> Case:
    n, r = be.size, be.rank
    out = torch.empty_like(mine)
    right, left = (r + 1) % n, (r - 1) % n
    x, o = arg(mine), arg(out)

    def run():
        if n == 1:
            out.copy_(mine)
            return
        works = [be.isend(x, right, 0), be.irecv(o, left, 0)]
        for w in works:
            w.wait()
    return Case(run, lambda: None, lambda: out, cpu_pats[left], count, size, refill)


def _slowest(be, seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64, device=device_of(be))
    be.all_reduce(t, ReduceOp.MAX, False)
    return float(t[0])


def _sync_of(be) -> Callable[[], None]:
    return torch.cuda.synchronize if device_of(be).type == "cuda" else (lambda: None)


def _wrong(be, case: Case) -> int:
    """Elements of this op's result that differ from the reference, summed over ranks."""
    count_wrong = getattr(be, "count_wrong", metrics.count_wrong)  # quantized: within the codec's bound
    wrong = torch.tensor([count_wrong(case.check().cpu(), case.expected)], dtype=torch.int64,
                         device=device_of(be))
    be.all_reduce(wrong, ReduceOp.SUM, False)
    return int(wrong[0])


def measure(coll: str, be, nbytes: int, dtype: torch.dtype, op: ReduceOp, iters: int, warmup: int,
            as_numpy: bool = False) -> dict:
    case = make_case(coll, be, nbytes, dtype, op, as_numpy)
    for _ in range(warmup):
        case.run()
    be.barrier(False)
    sync = _sync_of(be)
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        case.run()
    sync()  # NCCL returns before the GPU is done
    elapsed = _slowest(be, time.perf_counter() - start) / iters
    case.reset()
    case.run()
    alg = metrics.algbw(case.nbytes, elapsed)
    return {"size": case.nbytes, "count": case.count, "time_us": elapsed * 1e6, "algbw": alg,
            "busbw": metrics.busbw(coll, be.size, alg), "wrong": _wrong(be, case)}


def measure_alone(coll: str, backends: dict, nbytes: int, dtype: torch.dtype, op: ReduceOp,
                  samples: int, warmup: int, as_numpy: bool = False) -> dict[str, dict]:
    """Each backend's op timed one at a time (bench/alone.py), backends alternating sample by
    sample; the result of every backend's last sample is checked against the reference."""
    cases = {name: make_case(coll, be, nbytes, dtype, op, as_numpy) for name, be in backends.items()}
    for name, be in backends.items():
        for _ in range(warmup):
            alone.one_sample(be, cases[name].refill, cases[name].run, _sync_of(be))
    times = alone.interleave(samples, list(backends), lambda name: alone.one_sample(
        backends[name], cases[name].refill, cases[name].run, _sync_of(backends[name])))
    out = {}
    for name, be in backends.items():
        case = cases[name]
        slowest = alone.gather_slowest(be, times[name], device_of(be))
        out[name] = {"size": case.nbytes, "count": case.count, "wrong": _wrong(be, case),
                     **alone.summarize(slowest, coll, be.size, case.nbytes)}
    return out


def measure_size(spec: BenchSpec, backends: dict, nbytes: int, dtype, op, progress, label: str) -> dict:
    """One row: per backend the back-to-back figures, and under ``"alone"`` the op-by-op ones."""
    b2b, by_op = alone.parse_mode(spec.mode)
    as_numpy = spec.input == "numpy"
    row: dict = {}
    for name, be in backends.items():
        if b2b:
            if progress:
                progress(f"{label} on {name}")
            row[name] = measure(spec.collective, be, nbytes, dtype, op, spec.iters, spec.warmup, as_numpy)
    if by_op:
        if progress:
            progress(f"{label}, op by op on {', '.join(backends)}")
        for name, res in measure_alone(spec.collective, backends, nbytes, dtype, op, spec.iters,
                                       spec.warmup, as_numpy).items():
            base = row.setdefault(name, {k: res[k] for k in ("size", "count")} | {"wrong": 0})
            base["wrong"] += res.pop("wrong")
            base["alone"] = res
    return row


def backend_variant(name: str) -> tuple[str, int | None]:
    """``zmq``, ``zmq+hier``, ``zmq@1M`` (piece size 1 MiB: ``[comm] chunk_bytes``) ->
    (backend, chunk_bytes or None). Variants of one backend run as separate groups in the same
    processes, so their settings are compared sample by sample (``--backend zmq,zmq@1M,gloo``)."""
    base, _, chunk = name.split("+")[0].partition("@")
    return base, (metrics.parse_size(chunk) if chunk else None)


def data_path(name: str, cfg, rt) -> str:
    """Which path a backend's bytes take between this node's ranks: "shm" where ours uses shared
    memory (``[comm] intra_node``) and every rank shares this node; else "tcp". The efficiency
    column uses that path's ceiling."""
    intra = cfg.comm.intra_node
    one_node = all(rt.transport.counters.same_node or [True])
    return "shm" if backend_variant(name)[0] == "zmq" and intra in ("auto", "shm") and one_node else "tcp"


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
        return dispatch.TwoLevelBackend(rt)
    if name.endswith(("+int8", "+int4")):
        from commrt.bench.quant import QuantBackend
        return QuantBackend(rt, name.rsplit("+", 1)[1])
    return rt.world.backend


def run(spec: BenchSpec, progress: Callable[[str], None] | None = None, environ=os.environ,
        traffic: dict | None = None) -> list[dict]:
    """Run in every rank; returns the rows (identical on every rank). ``traffic``, if given, gets
    per backend the bytes all ranks sent inside nodes and across nodes (see ``node_traffic``).
    A backend named ``<name>+hier`` is ``<name>`` with the hierarchical collectives."""
    rdzv = rendezvous.resolve("env://", None, None, environ)
    dtype, op = parse_dtype(spec.dtype), parse_op(spec.op)
    if spec.device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"rank {rdzv.rank}: --device cuda, but torch sees no CUDA device")
    _DEVICE["all"] = spec.device
    cfg = load_config()
    transport = Transport(cfg, f"rank{rdzv.rank}")
    store, server = bootstrap.open_store(transport, rdzv, cfg.comm.timeout_s)
    runtimes = {}
    try:
        for name in spec.backends:
            kind, chunk = backend_variant(name)
            comm = dataclasses.replace(cfg.comm, backend=kind, **({"chunk_bytes": chunk} if chunk else {}))
            bcfg = dataclasses.replace(cfg, comm=comm)
            runtimes[name] = bootstrap.init_world(bcfg, rdzv, store=(store, None), namespace=f"{name}/")
        backends = {name: _backend(name, rt) for name, rt in runtimes.items()}
        first = runtimes[spec.backends[0]].world.backend
        ring = physical.TcpRing.open(store, rdzv.rank, rdzv.world_size, cfg.cluster.bind_host) if spec.physical else None
        rows = []
        sizes = metrics.size_series(spec.min_bytes, spec.max_bytes, spec.factor)
        for i, nbytes in enumerate(sizes):
            label = f"[{i + 1}/{len(sizes)}] {spec.collective} {metrics.format_size(nbytes)}"
            row = measure_size(spec, backends, nbytes, dtype, op, progress, label)
            for name, rt in runtimes.items():
                row[name]["path"] = data_path(name, cfg, rt)
            if ring is not None:
                row["ceiling"] = ring.measure(first, nbytes, spec.iters, spec.warmup)
                row["memory"] = physical.memory_ceiling(first, spec.collective, nbytes, spec.iters, spec.warmup)
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
