"""What each rank does in ``commrt bench``: set up every requested backend side by side,
then for each size measure each backend in turn (interleaved, because this machine is noisy)
and check the results of every size against a locally computed reference."""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable

import torch

from commrt.runtime import bootstrap, rendezvous
from commrt.topology import dispatch
from commrt.obs import stats
from commrt.transport.transport import Transport
from commrt.collectives.reduce_ops import ReduceOp, parse_op
from commrt.runtime.config import load_config
from commrt.runtime.errors import ConfigError
from commrt.runtime.dtypes import parse_dtype
from commrt.bench import alone, metrics, physical
from commrt.bench.cases import (_DEVICE, Case, device_of, distinct_sizes, make_case, pattern,  # noqa: F401
                                reference)  # (p2p.py, apps)


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

    def __post_init__(self):
        # checked where the spec is made, before any rank starts: -n 0 divided by zero on every
        # rank after the start-up (back-to-back) or raised "no samples" (alone)
        if self.iters < 1 or self.warmup < 0:
            raise ConfigError(f"need iters >= 1 and warmup >= 0, got -n {self.iters}, -w {self.warmup}")
        metrics.size_series(self.min_bytes, self.max_bytes, self.factor)
        twice = sorted({b for b in self.backends if self.backends.count(b) > 1})
        if twice:  # one world per name: a second in the same namespace failed with "duplicate rank"
            raise ConfigError(f"--backend (with --algo, --quant) names {', '.join(twice)} twice; name each column once")
        alone.parse_mode(self.mode)
        try:  # each rank parsed them after the start-up: a traceback per rank
            parse_dtype(self.dtype), parse_op(self.op)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        quantized = [b for b in self.backends if b.endswith(("+int8", "+int4"))]
        if quantized:
            self._check_quant(quantized)

    def _check_quant(self, names: list[str]) -> None:
        """A +int8 / +int4 column measures the quantized op only for a float payload, a sum or
        mean, torch input and the three collectives it has: QuantBackend hands anything else to
        the exact backend, so -o max, -d int32 or a broadcast printed exact times under the
        quantized column's name (and reduce_scatter -o max, or --input numpy, failed after the
        start-up)."""
        why = []
        if self.collective not in ("all_reduce", "reduce_scatter", "all_gather"):
            why.append(f"the collective is {self.collective} (quantized: all_reduce, reduce_scatter, all_gather)")
        if parse_dtype(self.dtype) not in (torch.float32, torch.float16, torch.bfloat16):
            why.append(f"-d {self.dtype} (quantized: float32, float16, bfloat16)")
        if self.collective != "all_gather" and parse_op(self.op) not in (ReduceOp.SUM, ReduceOp.AVG):
            why.append(f"-o {self.op} (quantized: sum, avg)")
        if self.input != "torch":
            why.append(f"--input {self.input} (quantized: torch)")
        if why:
            raise ConfigError(f"{', '.join(names)}: no quantized op to measure: {'; '.join(why)}")


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
    sample; then one more op of each, its output reset first (``Case.reset``), is checked
    against the reference."""
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
        case.reset()
        case.run()
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
    base, _, chunk = name.split("+")[0].partition(":")[0].partition("@")
    return base, (metrics.parse_size(chunk) if chunk else None)


def algorithm_variant(name: str) -> str | None:
    """``zmq:rabenseifner`` (``commrt bench --algo``) -> the schedule pinned, or None."""
    return name.split("+")[0].partition(":")[2] or None


def _variant_config(cfg, name: str, collective: str):
    """The config of one backend column: its piece size, and for ``:ALGO`` the schedule pinned
    over TCP (``[comm] algorithms``; the shared-memory path has its own schedules, so ``:ALGO``
    columns run ``intra_node = "tcp"``)."""
    kind, chunk = backend_variant(name)
    comm = dataclasses.replace(cfg.comm, backend=kind, **({"chunk_bytes": chunk} if chunk else {}))
    algorithm = algorithm_variant(name)
    if algorithm:
        comm = dataclasses.replace(comm, algorithms=f"{collective}={algorithm}", intra_node="tcp")
    return dataclasses.replace(cfg, comm=comm)


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
    runtimes, ring = {}, None
    try:
        configs = {name: _variant_config(cfg, name, spec.collective) for name in spec.backends}
        for name in spec.backends:
            runtimes[name] = bootstrap.init_world(configs[name], rdzv, store=(store, None), namespace=f"{name}/")
        backends = {name: _backend(name, rt) for name, rt in runtimes.items()}
        first = runtimes[spec.backends[0]].world.backend
        if spec.physical:  # peers dial the address the transport advertises, as they do the transport's
            where = rendezvous.advertised_host(cfg.cluster.bind_host, cfg.cluster.advertise_host, rdzv.host)
            ring = physical.TcpRing.open(store, rdzv.rank, rdzv.world_size, cfg.cluster.bind_host, advertise=where)
        rows = []
        sizes = distinct_sizes(spec.collective, rdzv.world_size,
                               metrics.size_series(spec.min_bytes, spec.max_bytes, spec.factor), dtype.itemsize)
        for i, nbytes in enumerate(sizes):
            label = f"[{i + 1}/{len(sizes)}] {spec.collective} {metrics.format_size(nbytes)}"
            row = measure_size(spec, backends, nbytes, dtype, op, progress, label)
            for name, rt in runtimes.items():
                row[name]["path"] = data_path(name, configs[name], rt)
            if ring is not None:
                row["ceiling"] = ring.measure(first, nbytes, spec.iters, spec.warmup)
                row["memory"] = physical.memory_ceiling(first, spec.collective, nbytes, spec.iters, spec.warmup)
            rows.append(row)
        if traffic is not None:
            traffic.update({name: node_traffic(rt) for name, rt in runtimes.items()})
            for name, be in backends.items():
                if hasattr(be, "summary"):
                    traffic[name]["quant"] = be.summary()
        return rows
    finally:
        if ring is not None:  # its sockets, when a size failed too
            ring.close()
        for rt in runtimes.values():
            bootstrap.shutdown(rt, keep_store=True)
        store.close()
        if server is not None:
            server.close()
        transport.close()
