"""The training engine's configuration, read from DeepSpeed's keys so its users need nothing new.

``TrainConfig.from_dict`` takes the same dict as ``deepspeed.initialize(config=...)`` (or the
``[train]`` table of the TOML file) and refuses unknown keys with the list of valid ones.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from commrt.runtime.errors import ConfigError
from commrt.optim.rules import OptimSpec
from commrt.optim.schedules import LRSchedule
from commrt.train.collector import check_interval

_ZERO_KEYS = {"stage", "reduce_bucket_size", "allgather_bucket_size", "overlap_comm",
              "stage3_prefetch_bucket_size", "contiguous_gradients", "reduce_scatter", "sharding_strategy",
              "zero_hpz_partition_size", "mics_shard_size", "shard_group_size",
              "zero_quantized_weights", "zero_quantized_gradients", "zeropp_loco_param", "overlap_step"}
_TOP_KEYS = {"zero_optimization", "optimizer", "gradient_accumulation_steps", "gradient_clipping",
             "bf16", "train_micro_batch_size_per_gpu", "train_batch_size", "non_finite_grads",
             "fault_tolerance", "manual_gc_interval", "scheduler"}
# FSDP's strategies (torch.distributed.fsdp.ShardingStrategy) as (ZeRO stage, hybrid)
STRATEGIES = {"FULL_SHARD": (3, False), "SHARD_GRAD_OP": (2, False), "NO_SHARD": (0, False),
              "HYBRID_SHARD": (3, True), "_HYBRID_SHARD_ZERO2": (2, True)}
_NAMED = {"sharding_strategy"}  # keys whose values are names, not numbers
_OPTIMIZERS = {"adamw": "adamw", "adam": "adamw", "lamb": "lamb", "sgd": "sgd"}


@dataclass(frozen=True)
class ZeroConfig:
    stage: int | None = None
    """0: data parallel; 1: optimizer state sharded; 2: + gradients; 3: + parameters (default 0,
    or what ``sharding_strategy`` implies)."""
    reduce_bucket_size: int = 6_553_600
    """Elements per gradient bucket (stages 0-2): a bucket is reduced as soon as it is full, the
    first at most 1 MiB (torch DDP's buckets; the default is its 25 MiB in fp32). Reductions
    start during backward only when the model spans several buckets: at 25M elements a 7.5M
    model was one bucket, reduced after backward."""
    allgather_bucket_size: int = 25_000_000
    """Kept for DeepSpeed compatibility; parameters are gathered per bucket (stages 1-2)."""
    overlap_comm: bool = True
    """Start each bucket's reduction from the gradient hooks while backward is still running."""
    stage3_prefetch_bucket_size: int = 50_000_000
    """Stage 3: while a module runs, gather the modules after it (in execution order) up to this
    many elements ahead, at least one (0 disables prefetch)."""
    zero_quantized_weights: bool = False
    """Stage 3 (ZeRO++ qwZ): gather parameters in int8 (block-wise scales). The fp32 master
    weights and the optimizer state stay exact; only the compute copy is quantized. With
    ``overlap_comm`` the quantized gathers run on the engine's comm thread, beside compute."""
    zero_quantized_gradients: bool = False
    """ZeRO++ qgZ: reduce gradients in int4: an all-to-all of int4 chunks, then an fp32
    reduction (stages 2-3: reduce-scatter; 0-1: all-reduce), from the hooks: on the engine's
    comm thread with ``overlap_comm``, else synchronously."""
    zeropp_loco_param: dict | None = None
    """LoCo error feedback for the quantized gradients: ``{"err_beta": 0.8, "reset_T": 1024}``
    as in DeepSpeed; None: off."""

    sharding_strategy: str | None = None
    """FSDP's name for the stage, instead of ``stage``: FULL_SHARD (3), SHARD_GRAD_OP (2),
    NO_SHARD (0), HYBRID_SHARD (stage 3 inside each shard group, replicated across groups),
    _HYBRID_SHARD_ZERO2 (the same at stage 2), or "auto" (hybrid when the job spans nodes)."""
    zero_hpz_partition_size: int | str = 1
    """ZeRO++ hpZ (stage 3): also keep a secondary copy of the parameters sharded over groups of
    this many ranks (a node); backward gathers read it instead of crossing nodes. 1: off;
    "auto": the ranks per node when the job spans nodes."""
    mics_shard_size: int = -1
    """DeepSpeed MiCS (stage 3): shard over groups of this many ranks, replicated across the
    groups; the same as HYBRID_SHARD with ``shard_group_size``. -1: off."""
    shard_group_size: int = 0
    """HYBRID_SHARD / _HYBRID_SHARD_ZERO2: ranks per shard group; 0: the ranks per node."""
    overlap_step: bool = True
    """HYBRID_SHARD / MiCS (stage 3): keep the link between replicas busy across the step. The
    replica all-reduces of the units forward runs first start after backward, in forward order,
    and ``step()`` only marks the step due: each unit steps just before the next forward gathers
    it, while the later units' bytes still cross (``train/zero_defer.py``). Bit-identical values;
    off (or no effect) with gradient clipping, LAMB, qwZ/qgZ or ``overlap_comm = false``, and the
    grad norm reported (``last_grad_norm``) is NaN while it is on."""

    def __post_init__(self) -> None:
        stage = _stage_of(self)
        if stage not in (0, 1, 2, 3):
            raise ConfigError(f"zero_optimization.stage = {stage!r} is invalid; valid: [0, 1, 2, 3]")
        object.__setattr__(self, "stage", stage)
        if self.zero_quantized_weights and self.stage != 3:
            raise ConfigError("zero_optimization.zero_quantized_weights needs stage 3 (qwZ quantizes the "
                              f"stage-3 parameter gathers); stage is {self.stage}")
        if self.zeropp_loco_param is not None:
            if not self.zero_quantized_gradients:
                raise ConfigError("zero_optimization.zeropp_loco_param needs zero_quantized_gradients: true")
            _check_loco(self.zeropp_loco_param)
        if self.reduce_bucket_size < 1:
            raise ConfigError("zero_optimization.reduce_bucket_size must be >= 1")
        if self.stage3_prefetch_bucket_size < 0:
            raise ConfigError(f"zero_optimization.stage3_prefetch_bucket_size = {self.stage3_prefetch_bucket_size} "
                              "is invalid; valid: an integer >= 0 (0: no prefetch)")
        _check_groups(self)

    @property
    def hybrid(self) -> bool:
        """Sharded inside groups and replicated across them (HSDP, MiCS)."""
        return self.mics_shard_size > 0 or STRATEGIES.get(self.sharding_strategy or "", (0, False))[1]


def _check_loco(loco) -> None:
    """DeepSpeed's ``{"err_beta": 0.8, "reset_T": 1024}`` (a bare ``true``, a list or a string
    value failed with a TypeError or AttributeError; a reset_T of 2.5 ran as 2)."""
    def number(v) -> bool:
        return not isinstance(v, bool) and isinstance(v, (int, float))
    ok = isinstance(loco, Mapping) and not set(loco) - {"err_beta", "reset_T"}
    beta, reset = (loco.get("err_beta", 0.8), loco.get("reset_T", 1024)) if ok else (None, None)
    if not (ok and number(beta) and 0 <= beta < 1 and number(reset) and float(reset).is_integer() and reset >= 0):
        raise ConfigError(f"zero_optimization.zeropp_loco_param = {loco!r:.100} is invalid; a table of valid keys: "
                          "err_beta (a number in [0, 1)) and reset_T (an integer >= 0)")


def _stage_of(z: ZeroConfig) -> int:
    """The stage ``stage`` and ``sharding_strategy`` agree on (giving both, differently, is an error)."""
    name = z.sharding_strategy
    if name is None or name == "auto":
        return 0 if z.stage is None else z.stage
    if name not in STRATEGIES:
        raise ConfigError(f"zero_optimization.sharding_strategy = {name!r} is invalid; valid: "
                          f"{sorted(STRATEGIES) + ['auto']}")
    implied = STRATEGIES[name][0]
    if z.stage is not None and z.stage != implied:
        raise ConfigError(f"zero_optimization.stage = {z.stage} contradicts sharding_strategy = {name!r} "
                          f"(stage {implied}); give one of them")
    return implied


def _check_groups(z: ZeroConfig) -> None:
    """What can be checked without knowing the world size."""
    hpz, mics, size = z.zero_hpz_partition_size, z.mics_shard_size, z.shard_group_size
    if hpz != "auto" and (isinstance(hpz, bool) or not isinstance(hpz, int) or hpz < 1):
        raise ConfigError(f"zero_hpz_partition_size = {hpz!r} is invalid; valid: an int >= 1 (1: off) or 'auto'")
    if (hpz == "auto" or hpz > 1) and z.stage != 3:
        raise ConfigError(f"zero_hpz_partition_size = {hpz!r} needs stage 3 (FULL_SHARD), not stage {z.stage}; "
                          "for stage 2 inside each node use sharding_strategy = '_HYBRID_SHARD_ZERO2'")
    if mics != -1 and mics < 1:
        raise ConfigError(f"mics_shard_size = {mics} is invalid; valid: -1 (off) or >= 1")
    if mics > 0 and (z.stage != 3 or z.sharding_strategy not in (None, "HYBRID_SHARD")):
        raise ConfigError(f"mics_shard_size needs stage 3 (it is HYBRID_SHARD with shard_group_size = {mics}); "
                          f"got stage {z.stage}, sharding_strategy {z.sharding_strategy!r}; for stage 2 use "
                          "sharding_strategy = '_HYBRID_SHARD_ZERO2' with shard_group_size")
    if mics > 0 and size not in (0, mics):
        raise ConfigError(f"mics_shard_size = {mics} and shard_group_size = {size} disagree; give one")
    if size < 0 or (size and not z.hybrid):
        raise ConfigError(f"shard_group_size = {size} applies only to sharding_strategy HYBRID_SHARD or "
                          "_HYBRID_SHARD_ZERO2 (must be >= 1); for stage 3 groups inside a node without "
                          "replicas use zero_hpz_partition_size")
    if z.hybrid and (hpz == "auto" or hpz > 1):
        raise ConfigError("zero_hpz_partition_size cannot be combined with hybrid sharding (HYBRID_SHARD, "
                          "MiCS): parameters already live inside the shard group")


@dataclass(frozen=True)
class TrainConfig:
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    optimizer: OptimSpec = field(default_factory=lambda: OptimSpec("adamw", lr=1e-3))
    """DeepSpeed's ``optimizer`` table: type AdamW (or Adam, run as AdamW), LAMB or SGD, with lr,
    betas, eps, weight_decay, momentum, nesterov; ``adam_w_mode`` and ``bias_correction`` only
    as true (their default; false is a ConfigError, not Adam with L2 decay or raw moments)."""
    scheduler: LRSchedule | None = None
    """DeepSpeed's ``scheduler`` table: WarmupLR, WarmupDecayLR or WarmupCosineLR with its params
    (``optim/schedules.py``); the engine sets each step's learning rate from the number of steps
    taken. None: the optimizer's ``lr`` (or ``engine.set_lr``'s) for every step."""
    gradient_accumulation_steps: int = 1
    gradient_clipping: float = 0.0
    """Clip the global gradient norm (over all shards) to this value; 0 disables."""
    bf16: bool = False
    """bf16 compute and communication with fp32 master weights and optimizer state."""
    non_finite_grads: str = "skip"
    """A NaN/inf in any rank's gradients: 'skip' the step on every rank (counted), or 'raise'
    an error naming the ranks. Parameters never receive a non-finite update."""
    train_batch_size: int | None = None
    """DeepSpeed's global batch (samples per optimizer step over every rank); the engine does
    not split batches, so it only checks it: it must equal train_micro_batch_size_per_gpu x
    gradient_accumulation_steps x the data-parallel world size (``check_batch``). None: unchecked."""
    train_micro_batch_size_per_gpu: int | None = None
    """DeepSpeed's batch per rank and backward; only checked (``train_batch_size``)."""
    fault_tolerance: str = "off"
    """'replica': a replica that dies or times out is dropped at the step it failed in and the
    others go on; a restarted one rejoins with the live state (``train/replica_ft.py``). At
    stage 0 a replica is a rank holding the whole state. With HYBRID_SHARD /
    _HYBRID_SHARD_ZERO2 (``shard_group_size``, default the ranks per node), MiCS
    (``mics_shard_size``) or hpZ (``zero_hpz_partition_size``) a replica is a group of that many
    ranks (a node) that is dropped and rejoins as a whole; inside it, every rank keeps the whole
    parameters and the group shards the gradients and the optimizer state (ZeRO-2 inside the
    group, ``train/replica_group.py``), where the engine's HYBRID_SHARD / MiCS / hpZ without
    fault tolerance also shard the parameters (ZeRO-3). Stages 1-3 without groups are refused."""

    manual_gc_interval: int = 0
    """Python's garbage collector at step boundaries (``train/collector.py``, Megatron-LM's
    ``--manual-gc``): N >= 1: after the first step one full collection and ``gc.freeze()``,
    then the automatic collector off and a full collection every N optimizer steps, on every
    rank at the same step. 0: Python's automatic collector, untouched (it may run mid-step on
    each rank at another moment: up to ~120 ms each, which a pipeline's other stages wait for).
    The engine, the pipeline schedules (their ``manual_gc_interval`` argument) and ``train_lm``'s
    replica loop (at the job's step) call it; the collector is the process's, turned back on by
    ``close()``."""

    def __post_init__(self) -> None:
        check_interval(self.manual_gc_interval)
        if self.gradient_accumulation_steps < 1:
            raise ConfigError("gradient_accumulation_steps must be >= 1")
        if not self.gradient_clipping >= 0:  # NaN too
            raise ConfigError(f"gradient_clipping = {self.gradient_clipping!r} is invalid; valid: a number >= 0")
        for key in ("train_batch_size", "train_micro_batch_size_per_gpu"):
            v = getattr(self, key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ConfigError(f"{key} = {v!r} is invalid; valid: an integer >= 1")
        if self.non_finite_grads not in ("skip", "raise"):
            raise ConfigError(f"non_finite_grads = {self.non_finite_grads!r} is invalid; valid: ['skip', 'raise']")
        _check_fault_tolerance(self)

    def check_batch(self, world: int) -> None:
        """DeepSpeed derives gradient_accumulation_steps from the two batch sizes; this engine
        takes it as given, so sizes that imply another value are an error, not a silently
        different optimizer step (a config written for DeepSpeed with train_batch_size 32, micro
        batch 4 at 2 ranks means 4 accumulation steps, which this engine used to run as 1)."""
        total, micro = self.train_batch_size, self.train_micro_batch_size_per_gpu
        if total is None or micro is None:
            return
        if total != micro * self.gradient_accumulation_steps * world:
            raise ConfigError(f"train_batch_size = {total} is not train_micro_batch_size_per_gpu ({micro}) x "
                              f"gradient_accumulation_steps ({self.gradient_accumulation_steps}) x the data-parallel "
                              f"world size ({world}) = {micro * self.gradient_accumulation_steps * world}; set "
                              "gradient_accumulation_steps (not derived here) or drop the batch sizes")

    def with_stage(self, stage: int) -> "TrainConfig":
        """This config at another stage (a sharding strategy given by name is dropped with it)."""
        return dataclasses.replace(self, zero=dataclasses.replace(self.zero, stage=stage, sharding_strategy=None))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None) -> "TrainConfig":
        raw = dict(_table(raw or {}, "the training config"))
        _only(raw, _TOP_KEYS, "the training config")
        zero = dict(_table(raw.get("zero_optimization", {}), "zero_optimization"))
        _only(zero, _ZERO_KEYS, "zero_optimization")
        zero.pop("contiguous_gradients", None)
        zero.pop("reduce_scatter", None)
        return cls(zero=ZeroConfig(**{k: _zero_value(k, v) for k, v in zero.items()}),
                   optimizer=_optimizer(raw.get("optimizer", {"type": "AdamW", "params": {"lr": 1e-3}})),
                   scheduler=None if raw.get("scheduler") is None else LRSchedule.from_dict(raw["scheduler"]),
                   gradient_accumulation_steps=_number("gradient_accumulation_steps",
                                                       raw.get("gradient_accumulation_steps", 1), int),
                   gradient_clipping=_number("gradient_clipping", raw.get("gradient_clipping", 0.0), float),
                   bf16=_enabled(raw.get("bf16", {})),
                   non_finite_grads=str(raw.get("non_finite_grads", "skip")),
                   train_batch_size=_batch(raw, "train_batch_size"),
                   train_micro_batch_size_per_gpu=_batch(raw, "train_micro_batch_size_per_gpu"),
                   fault_tolerance=raw.get("fault_tolerance", "off"),
                   manual_gc_interval=_number("manual_gc_interval", raw.get("manual_gc_interval", 0), int))


FAULT_TOLERANCE = ("off", "replica")


def _check_fault_tolerance(c: "TrainConfig") -> None:
    ft = c.fault_tolerance
    if ft not in FAULT_TOLERANCE:
        raise ConfigError(f"fault_tolerance = {ft!r} is invalid; valid: {list(FAULT_TOLERANCE)}")
    if ft != "replica":
        return
    if c.scheduler is not None:  # its loop steps torch's optimizer, not the engine: else silently ignored
        raise ConfigError("fault_tolerance = 'replica' steps torch's optimizer (train/replica_ft.py), which the "
                          "scheduler section does not reach; drop it and step a torch LR scheduler on that "
                          "optimizer after each ReplicaFT step")
    z = c.zero
    grouped = z.hybrid or z.zero_hpz_partition_size != 1
    if not grouped and z.stage != 0:
        raise ConfigError(f"fault_tolerance = 'replica' needs zero_optimization.stage 0 (every replica holds the "
                          f"whole training state) or replica groups (sharding_strategy HYBRID_SHARD or "
                          f"_HYBRID_SHARD_ZERO2, mics_shard_size, zero_hpz_partition_size); stage {z.stage} shards "
                          "it across all the ranks, so a dead rank's shard would be lost")
    if z.zero_quantized_weights or z.zero_quantized_gradients:
        raise ConfigError("fault_tolerance = 'replica' averages fp32 gradients through its own worlds "
                          "(train/replica_ft.py), not the engine's: zero_quantized_weights and "
                          "zero_quantized_gradients are not supported with it")


def _only(raw: Mapping, valid: set, where: str) -> None:
    unknown = sorted(set(raw) - valid)
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in {where}; valid: {sorted(valid)}")


_BOOL_KEYS = {"overlap_comm", "zero_quantized_weights", "zero_quantized_gradients", "overlap_step"}


def _zero_value(key: str, v):
    """A zero_optimization value as given, checked at load (issue 30.13): no silent int(1.5), no
    raw ValueError for "AUTO", no explicit shard group of 0 ranks."""
    if key in _NAMED or key == "zeropp_loco_param" or (v == "auto" and key == "zero_hpz_partition_size"):
        return v
    if key in _BOOL_KEYS:
        if isinstance(v, bool):
            return v
        raise ConfigError(f"zero_optimization.{key} = {v!r} is invalid; valid: true or false")
    if not isinstance(v, bool) and isinstance(v, (int, float)) and float(v).is_integer() and \
            not (key == "shard_group_size" and v == 0):
        return int(v)  # DeepSpeed's JSON configs write 5e8 for bucket sizes
    valid = {"zero_hpz_partition_size": "an integer >= 1 (1: off) or 'auto'",
             "shard_group_size": "an integer >= 1 (leave it out for the ranks per node)",
             "mics_shard_size": "-1 (off) or an integer >= 1", "stage": "[0, 1, 2, 3]"}
    raise ConfigError(f"zero_optimization.{key} = {v!r} is invalid; valid: {valid.get(key, 'an integer')}")


def _batch(raw: Mapping, key: str) -> int | None:
    v = raw.get(key)
    return None if v is None else _number(key, v, int)


def _number(key: str, v, typ: type):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (typ is int and not float(v).is_integer()):
        raise ConfigError(f"{key} = {v!r} is invalid; expected {'an integer' if typ is int else 'a number'}")
    return typ(v)


def _table(v, where: str) -> Mapping:
    """A table of the config (a TOML table, a JSON object), or a ConfigError saying what came instead."""
    if not isinstance(v, Mapping):
        raise ConfigError(f"{where} = {v!r:.100} is invalid; valid: a table of keys")
    return v


def _enabled(v) -> bool:
    """DeepSpeed's ``"bf16": {"enabled": true}`` (a bare ``true`` was a TypeError)."""
    on = _table(v, "bf16").get("enabled", False)
    if not isinstance(on, bool):
        raise ConfigError(f"bf16.enabled = {on!r} is invalid; valid: true or false")
    return on


def _optimizer(raw: Mapping) -> OptimSpec:
    raw = _table(raw, "optimizer")
    kind = _OPTIMIZERS.get(str(raw.get("type", "")).lower())
    if kind is None:
        raise ConfigError(f"optimizer type {raw.get('type')!r} is invalid; valid: AdamW, LAMB, SGD")
    params = dict(_table(raw.get("params", {}), "optimizer.params"))
    betas = params.pop("betas", None)
    if betas is not None:
        if isinstance(betas, (str, bytes)) or not isinstance(betas, (list, tuple)) or len(betas) != 2:
            raise ConfigError(f"optimizer.params.betas = {betas!r:.100} is invalid; valid: two numbers in [0, 1)")
        params["beta1"], params["beta2"] = betas
    valid = {"lr", "momentum", "nesterov", "weight_decay", "beta1", "beta2", "eps"}
    _only(params, valid | {"torch_adam", "adam_w_mode", "bias_correction"}, "optimizer.params")
    _only_true(params)
    return OptimSpec(kind, **{k: v for k, v in params.items() if k in valid})


def _only_true(params: Mapping) -> None:
    """DeepSpeed's ``adam_w_mode`` and ``bias_correction`` are accepted for its configs' sake, but
    the engine runs only what they default to: decoupled weight decay (AdamW; LAMB adds it to the
    direction) with bias-corrected moments. ``false`` was silently run as ``true``."""
    for key, runs in (("adam_w_mode", "decoupled weight decay (AdamW), not Adam with L2 decay"),
                      ("bias_correction", "bias-corrected moments")):
        v = params.get(key, True)
        if v is not True:
            raise ConfigError(f"optimizer.params.{key} = {v!r} is not supported; valid: true (the engine runs "
                              f"{runs}), or leave it out")


def load_train_config(path: str | os.PathLike | None) -> TrainConfig:
    """The ``[train]`` table of a TOML config file (DeepSpeed's keys); defaults without a file."""
    if not path:
        return TrainConfig()
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read the [train] table of {path}: {exc}") from None
    return TrainConfig.from_dict(data.get("train", {}))
