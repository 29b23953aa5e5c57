"""What one training step costs each rank, before running it: memory for parameters, gradients
and optimizer state, bytes sent inside the node and across nodes per collective, and the time
those take at given bandwidths. Pure: no processes, no sockets (``commrt estimate`` prints it).

The model follows what ``train/zero.py`` and the engine do per step (not the paper's ideal):

    every unit (a gradient bucket, stages 0-2; the caller's units for stage 3), padded to a
    multiple of the data-parallel world:
    stage 0-1  grads: all_reduce (AVG) over the world (stage 1 in fp32, not hybrid, not qgZ: a
               reduce_scatter into the owner's shard instead); qgZ: quantized all_reduce (int4 all_to_all
               + all_gather of the codes)
    stage 1-2  publish: all_gather of the unit over the shard group
    stage 2-3  grads: reduce_scatter over the shard group (qgZ: int4 all_to_all); hybrid: then an
               all_reduce of the shard over the replica group
    stage 3    forward gather: all_gather over the shard group (qwZ: of int8 codes + scales);
               backward gather: the same again, or with hpZ an all_gather of the secondary copy
               inside its group
    engine     one all_reduce of world+1 float64 (non-finite flags and the squared norm)
    qwZ / qgZ over the world spanning nodes: two hops, exact fp32 inside the node, the codes
               across nodes (``cost.q_all_gather`` and the others; sub-groups stay flat)

Memory is ``Engine.memory_report()``'s accounting: fp32 gradients and master values (so mixed
precision is 4 (master) + 2 (compute copy) + 4 (gradient) + 8 (Adam) bytes per parameter at
stage 0, rather than the ZeRO paper's 2 + 2 + 12), each divided by the shard count from the
stage that shards it. Pipeline stages (``pipeline`` > 1) are blocks of world/P consecutive
ranks, each training params/P with the same ZeRO setting inside its block; activations
(hidden x seq x micro_batch values per micro-batch) go forward and their gradients backward
across each stage boundary, once per micro-batch. Latency, compute overlap and the small
bootstrap traffic are not modelled.
"""
from __future__ import annotations

from dataclasses import dataclass

from commrt.runtime.errors import ConfigError
from commrt.collectives.selection import table_from
from commrt.runtime.config.comm import parse_algorithms
from commrt.quant.codecs import Codec
from commrt.train import sharding
from commrt.train.config import ZeroConfig
from commrt.plan import cost

ITEMSIZE = {"fp32": 4, "bf16": 2}
MAX_UNITS = 1_000_000
"""The most buckets the model lists (a 7e9-parameter model in the default buckets is 1,069)."""
OPT_STATES = {"adamw": 2, "lamb": 2, "sgd": 1, "sgd-no-momentum": 0}  # fp32 values per master element


@dataclass(frozen=True)
class Cluster:
    nodes: int = 1
    """Nodes in the job."""
    per_node: int = 1
    """Ranks on each node."""
    intra_bw: float = 100e9
    """Bytes/s one rank can send to another on its node."""
    inter_bw: float = 12.5e9
    """Bytes/s one node can send to the others (its network link, shared by its ranks)."""
    small_bytes: int = 64 << 10
    """[comm] small_bytes: up to this size reduce_scatter exchanges directly instead of in a ring."""
    chunk_bytes: int = 4 << 20
    """[comm] chunk_bytes (the hierarchical all_reduce's pipelined pieces)."""
    hierarchical: str = "auto"
    """[comm] hierarchical: auto | always | never."""
    algorithms: str = ""
    """[comm] algorithms: schedules pinned ahead of the selection table (its syntax)."""

    def __post_init__(self) -> None:
        parse_algorithms(self.algorithms)  # ConfigError naming what is valid
        if self.nodes < 1 or self.per_node < 1:
            raise ConfigError(f"nodes = {self.nodes} and per_node = {self.per_node} must both be >= 1")
        if self.intra_bw <= 0 or self.inter_bw <= 0:
            raise ConfigError("bandwidths must be > 0")
        if self.hierarchical not in ("auto", "always", "never"):  # --compare passes it unchecked
            raise ConfigError(f"hierarchical = {self.hierarchical!r} is invalid; valid: auto, always, never")


@dataclass(frozen=True)
class Job:
    params: int
    """Trainable parameters of the whole model."""
    stage: int | None = None
    """ZeRO stage 0-3 (or implied by ``strategy``)."""
    strategy: str | None = None
    """FSDP name: FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, _HYBRID_SHARD_ZERO2."""
    hpz: int = 1
    """ZeRO++ hpZ secondary group size (1: off)."""
    shard_group_size: int = 0
    """Hybrid: ranks per shard group (0: a node)."""
    quant_weights: str | None = None
    """qwZ: stage-3 gathers in int8 (or int4) codes plus fp32 scales per block."""
    quant_grads: str | None = None
    """qgZ: gradient reductions in int4 (or int8)."""
    dtype: str = "fp32"
    """Compute and communication dtype: fp32 | bf16 (master values and gradients stay fp32)."""
    optimizer: str = "adamw"
    """adamw | lamb | sgd (with momentum) | sgd-no-momentum."""
    bucket: int = ZeroConfig.reduce_bucket_size
    """Elements per unit when ``units`` is not given (reduce_bucket_size)."""
    units: tuple[int, ...] | None = None
    """Exact unit sizes in elements (from a real model), instead of ``params`` cut in buckets."""
    quant_block: int = 256
    pipeline: int = 1
    microbatches: int = 1
    hidden: int = 0
    seq: int = 0
    micro_batch: int = 1

    def __post_init__(self) -> None:
        for name, value in (("dtype", self.dtype), ("optimizer", self.optimizer)):
            valid = ITEMSIZE if name == "dtype" else OPT_STATES
            if value not in valid:
                raise ConfigError(f"{name} = {value!r} is invalid; valid: {sorted(valid)}")
        for name in ("quant_weights", "quant_grads"):
            if getattr(self, name) not in (None, "int8", "int4"):
                raise ConfigError(f"{name} = {getattr(self, name)!r} is invalid; valid: int8, int4")
        if self.params < 1 or self.pipeline < 1 or self.microbatches < 1:
            raise ConfigError("params, pipeline and microbatches must be >= 1")
        if self.hidden < 0 or self.seq < 0 or self.micro_batch < 1:
            raise ConfigError(f"hidden = {self.hidden} and seq = {self.seq} must be >= 0, micro_batch = "
                              f"{self.micro_batch} >= 1")
        if self.units is None and self.bucket >= 1 and self.params / self.bucket > MAX_UNITS:
            # unit_sizes lists every unit: 7e9 params in buckets of 1 was a 7e9-long list (MemoryError)
            raise ConfigError(f"params = {self.params} in buckets of {self.bucket} elements are more than "
                              f"{MAX_UNITS} units; raise bucket (reduce_bucket_size)")

    def zero(self) -> ZeroConfig:
        """The engine's own config object: the same validation and the same sharding plan."""
        return ZeroConfig(stage=self.stage, sharding_strategy=self.strategy, zero_hpz_partition_size=self.hpz,
                          shard_group_size=self.shard_group_size, reduce_bucket_size=self.bucket,
                          zero_quantized_weights=self.quant_weights is not None,
                          zero_quantized_gradients=self.quant_grads is not None)


@dataclass(frozen=True)
class Estimate:
    plan: sharding.Plan
    memory: dict[str, int]
    """Bytes per rank: parameters, gradients, optimizer_state, total (as memory_report)."""
    phases: dict[str, tuple[float, float]]
    """Per step and rank: collective kind -> (bytes inside the node, bytes to other nodes)."""
    by_op: dict[str, tuple[float, float]]
    """The same by wire op, as comm_stats()["by_op"] names them."""
    seconds: dict[str, float]
    """Predicted communication time per collective kind, and 'total'."""


def unit_sizes(job: Job, dp: int) -> list[int]:
    """Padded element counts of this rank's units (a multiple of the data-parallel world)."""
    if job.units is not None:
        raw = list(job.units)
    else:
        per_stage = -(-job.params // job.pipeline)
        raw = [job.bucket] * (per_stage // job.bucket) + ([per_stage % job.bucket] if per_stage % job.bucket else [])
    return [-(-max(n, 1) // dp) * dp for n in raw]


def memory(job: Job, p: sharding.Plan, units: list[int], dp: int) -> dict[str, int]:
    """``Engine.memory_report()`` for these units, computed instead of measured."""
    b = ITEMSIZE[job.dtype]
    own = [n if p.stage == 0 else n // p.shard for n in units]
    params = sum(4 * o for o in own) if p.stage == 3 or b != 4 else 0
    if p.stage < 3:
        params += sum(n * b for n in units)
    if p.secondary:
        params += sum(n // p.secondary * b for n in units)
    grads = sum(4 * (n if p.stage < 2 else o) for n, o in zip(units, own))
    state = OPT_STATES[job.optimizer] * 4 * sum(own)
    return {"parameters": params, "gradients": grads, "optimizer_state": state,
            "total": params + grads + state}


class _Step:
    """Collectives of one step, per collective kind (phase)."""

    def __init__(self, job: Job, p: sharding.Plan, net: cost.Net, dp: int):
        self.job, self.p, self.net, self.b = job, p, net, ITEMSIZE[job.dtype]
        self.world = cost.group(0, dp)
        hybrid = p.replicas > 1
        self.shard = cost.group(0, p.shard) if hybrid else self.world
        self.replica = cost.group(0, p.replicas, p.shard) if hybrid else None
        self.secondary = cost.group(0, p.secondary) if p.secondary else None
        self.phases: dict[str, cost.Traffic] = {}
        self.seconds: dict[str, float] = {}

    def _t(self, phase: str) -> cost.Traffic:
        self.seconds.setdefault(phase, 0.0)
        return self.phases.setdefault(phase, cost.Traffic())

    def op(self, phase: str, op: str, ranks, numel: int, itemsize: int) -> None:
        self._add(phase, cost.collective(self._t(phase), op, ranks, numel, itemsize, self.net))

    def _codec(self, quant: str) -> Codec:
        return Codec(bits=8 if quant == "int8" else 4, block=self.job.quant_block)

    def q_gather(self, phase: str, ranks, own: int) -> None:
        """quant.all_gather_into_tensor of ``own`` values per rank (see ``cost.q_all_gather``)."""
        self._add(phase, cost.q_all_gather(self._t(phase), ranks, own, self._codec(self.job.quant_weights).nbytes,
                                           self.net))

    def q_reduce_scatter(self, phase: str, ranks, out: int) -> None:
        """quant.reduce_scatter_tensor to ``out`` values per rank (see ``cost.q_reduce_scatter``)."""
        self._add(phase, cost.q_reduce_scatter(self._t(phase), ranks, out, self._codec(self.job.quant_grads).nbytes,
                                               self.net))

    def q_all_reduce(self, phase: str, ranks, numel: int) -> None:
        """quant.all_reduce of ``numel`` values (see ``cost.q_all_reduce``)."""
        self._add(phase, cost.q_all_reduce(self._t(phase), ranks, numel, self._codec(self.job.quant_grads).nbytes,
                                           self.net))

    def _add(self, phase: str, seconds: float | None) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + (seconds or 0.0)

    def unit(self, n: int) -> None:
        p, b, job = self.p, self.b, self.job
        own = n // p.shard
        if p.stage == 3:
            self._gather("forward all_gather", own)
            if self.secondary is not None:
                self.op("hpZ secondary all_gather", "all_gather", self.secondary, n, b)
            else:
                self._gather("backward all_gather", own)
        # stage 1 in fp32, unquantized and not hybrid reduce-scatters into the owner's shard (zero.py)
        scatter = p.stage >= 2 or (p.stage == 1 and self.replica is None and not job.quant_grads
                                   and job.dtype == "fp32")
        if not scatter:
            if job.quant_grads:
                self.q_all_reduce("gradient all_reduce", self.world, n)
            else:
                self.op("gradient all_reduce", "all_reduce", self.world, n, b)
        elif job.quant_grads:
            self.q_reduce_scatter("gradient reduce_scatter", self.shard, own)
        else:
            self.op("gradient reduce_scatter", "reduce_scatter", self.shard, n, b)
        if p.stage >= 2 and self.replica is not None:
            self.op("replica all_reduce", "all_reduce", self.replica, own, b)
        if p.stage in (1, 2):
            self.op("publish all_gather", "all_gather", self.shard, n, b)

    def _gather(self, phase: str, own: int) -> None:
        if self.job.quant_weights:
            self.q_gather(phase, self.shard, own)
        else:
            self.op(phase, "all_gather", self.shard, own * len(self.shard), self.b)

    def pipeline(self, stages: int, dp: int) -> None:
        """Activations forward and their gradients backward across each stage boundary; the
        boundary between blocks of dp consecutive ranks crosses nodes when they sit on two."""
        job = self.job
        act = job.hidden * job.seq * job.micro_batch * self.b
        if stages < 2 or act <= 0:
            return
        t = self._t("pipeline p2p")
        per_node = self.net.per_node
        for s in range(stages - 1):  # rank i of block s pairs with rank i of block s+1
            for i in range(dp):
                a, c = s * dp + i, (s + 1) * dp + i
                nbytes = 2 * job.microbatches * act / (stages * dp)  # mean per rank, both directions
                same = a // per_node == c // per_node
                t.add("p2p", nbytes if same else 0.0, 0.0 if same else nbytes)
        self.seconds["pipeline p2p"] = self.net.seconds(t.intra, t.inter)


def estimate(job: Job, cluster: Cluster) -> Estimate:
    """The per-rank memory and per-step traffic and time of ``job`` on ``cluster``."""
    world = cluster.nodes * cluster.per_node
    if world % job.pipeline:
        raise ConfigError(f"pipeline = {job.pipeline} does not divide the world of {world} ranks")
    dp = world // job.pipeline
    p = sharding.plan(job.zero(), dp, min(cluster.per_node, dp))
    net = cost.Net(cluster.nodes, cluster.per_node, cluster.small_bytes, cluster.chunk_bytes, cluster.hierarchical,
                   cluster.intra_bw, cluster.inter_bw, table_from(parse_algorithms(cluster.algorithms)))
    units = unit_sizes(job, dp)
    step = _Step(job, p, net, dp)
    for n in units:
        step.unit(n)
    step.op("engine checks all_reduce", "all_reduce", step.world, dp + 1, 8)
    step.pipeline(job.pipeline, dp)
    by_op = cost.Traffic()
    for t in step.phases.values():
        by_op.merge(t)
    seconds = {k: v for k, v in step.seconds.items()}
    seconds["total"] = sum(seconds.values())
    return Estimate(p, memory(job, p, units, dp), {k: (t.intra, t.inter) for k, t in step.phases.items()},
                    {k: (a, b) for k, (a, b) in by_op.by_op.items()}, seconds)
