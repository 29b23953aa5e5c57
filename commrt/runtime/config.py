"""Typed, frozen configuration: one TOML file maps one-to-one onto these dataclasses.

Precedence (lowest first): dataclass defaults < TOML file < environment variables
(``COMMRT_<SECTION>_<FIELD>``, e.g. ``COMMRT_COMM_BACKEND=gloo``) < explicit overrides
(CLI flags or keyword arguments). Environment variables are read here and nowhere else.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from commrt.runtime.errors import ConfigError

BACKEND_NAMES = ("auto", "zmq", "gloo", "nccl")
HIERARCHICAL_MODES = ("auto", "always", "never")
INTRA_NODE_MODES = ("auto", "shm", "tcp")


def _check_choice(section: str, name: str, value: Any, valid: tuple) -> None:
    if value not in valid:
        raise ConfigError(f"[{section}] {name} = {value!r} is invalid; valid: {list(valid)}")


def _check_positive(section: str, name: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"[{section}] {name} = {value!r} is invalid; it must be > 0")


MAX_TIMEOUT_S = 1_000_000.0  # ~11.6 days; ZeroMQ takes timeouts as int32 milliseconds (~24.8 days)
MAX_HEARTBEAT_S = 3600.0  # 3 heartbeats (the timeout) in int32 milliseconds, with room to spare


def _check_seconds(section: str, name: str, value: float, most: float) -> None:
    """Durations become int32 milliseconds in socket options: bound them (inf and NaN fail)."""
    if not 0 < value <= most:
        raise ConfigError(f"[{section}] {name} = {value!r} is invalid; it must be > 0 and <= {int(most)}")


@dataclass(frozen=True)
class CommConfig:
    backend: str = "auto"
    """Which backend runs the collectives: auto | zmq | gloo | nccl. ``auto`` picks NCCL when
    CUDA is usable and every local rank has its own GPU, else ZMQ."""
    timeout_s: float = 300.0
    """Deadline for every blocking wait (a receive, a send that cannot drain, init)."""
    chunk_bytes: int = 4 << 20
    """Payloads are pipelined in pieces of at most this many bytes (pyzmq slows down on very
    large single messages, and small pieces let send, receive and reduce overlap)."""
    small_bytes: int = 64 << 10
    """Tensors up to this size use latency-optimal algorithms (direct exchange) instead of the
    bandwidth-optimal ring."""
    max_frame_bytes: int = 64 << 20
    """Largest single frame a socket accepts (ZMQ_MAXMSGSIZE); must exceed chunk_bytes."""
    heartbeat_s: float = 1.0
    """ZMTP heartbeat interval: a peer silent for 3 intervals is declared lost."""
    keep_freed_memory: bool = False
    """Let this process reuse freed multi-MiB buffers instead of returning them to the kernel
    (glibc's malloc thresholds, set once per process): without it every received piece is
    page-faulted in afresh, about a tenth of a rank's CPU at 64 MiB. Freed memory then stays
    in the process, as with any caching allocator. Off by default because it changes the whole
    process; ``commrt launch`` gives its ranks the same thresholds through GLIBC_TUNABLES
    (``COMMRT_COMM_KEEP_FREED_MEMORY=0`` in its environment turns that off)."""
    check_call_sites: bool = False
    """Debug aid (like TORCH_DISTRIBUTED_DEBUG=DETAIL): each collective also carries a hash of
    the source line that called it, so a rank that skipped a collective is caught even when the
    next one looks the same. Off by default: correct programs may call one collective from
    different lines on different ranks."""
    hierarchical: str = "auto"
    """Collectives over the world group when it spans several nodes with several ranks on each:
    ``always`` runs all_reduce, reduce_scatter_tensor and all_gather_into_tensor in two levels
    (inside each node, then across nodes on 1/M of the data), ``never`` flat, ``auto``
    hierarchically above small_bytes per rank's cross-node part when a one-time probe (mesh.py)
    finds two levels >= 1.1x faster (comm_stats()["hierarchical_auto"]). All ranks must agree."""
    intra_node: str = "auto"
    """How ranks of one node (one host and network namespace) exchange collective payloads:
    ``auto`` through shared memory where the host allows it (x86-64, /dev/shm writable), else
    TCP; ``shm`` shared memory or an error; ``tcp`` always the zmq/TCP path. All ranks must agree."""

    def __post_init__(self) -> None:
        _check_choice("comm", "backend", self.backend, BACKEND_NAMES)
        _check_choice("comm", "hierarchical", self.hierarchical, HIERARCHICAL_MODES)
        _check_choice("comm", "intra_node", self.intra_node, INTRA_NODE_MODES)
        for name in ("chunk_bytes", "small_bytes", "max_frame_bytes"):
            _check_positive("comm", name, getattr(self, name))
        _check_seconds("comm", "timeout_s", self.timeout_s, MAX_TIMEOUT_S)
        _check_seconds("comm", "heartbeat_s", self.heartbeat_s, MAX_HEARTBEAT_S)
        if self.max_frame_bytes < self.chunk_bytes + 4096:
            raise ConfigError(
                f"[comm] max_frame_bytes = {self.max_frame_bytes} is invalid; it must exceed "
                f"chunk_bytes ({self.chunk_bytes}) by at least 4096"
            )


@dataclass(frozen=True)
class ClusterConfig:
    rendezvous: str = "env://"
    """Where ranks meet: ``env://`` (torchrun variables) or ``tcp://host:port``."""
    world_size: int = 0
    """Number of ranks; 0 means: take it from the environment (WORLD_SIZE)."""
    rank: int = -1
    """This process's rank; -1 means: take it from the environment (RANK)."""
    bind_host: str = "127.0.0.1"
    """Interface the data-plane sockets bind to. Loopback unless told otherwise."""
    advertise_host: str = ""
    """Address peers use to reach this rank; empty means the same as bind_host."""

    def __post_init__(self) -> None:
        if self.world_size < 0:
            raise ConfigError(f"[cluster] world_size = {self.world_size} is invalid; must be >= 0")
        if self.rank < -1:
            raise ConfigError(f"[cluster] rank = {self.rank} is invalid; must be >= -1")
        if not (self.rendezvous == "env://" or self.rendezvous.startswith("tcp://")):
            raise ConfigError(
                f"[cluster] rendezvous = {self.rendezvous!r} is invalid; "
                "valid: 'env://' or 'tcp://host:port'"
            )


SECURITY_MODES = ("secret", "curve", "none")


@dataclass(frozen=True)
class SecurityConfig:
    mode: str = "secret"
    """Peer authentication on every TCP socket:
    secret (default): ZeroMQ PLAIN checked by a ZAP handler against a job secret; costs one
    check per connection, nothing per message, but the secret crosses the wire in the clear,
    so it is for loopback and trusted fabrics. curve: ZeroMQ CURVE, encrypted, each process
    holds a key pair and only keys on the job's allow-list get in. none: no authentication."""
    secret_file: str = ""
    """For secret: where the job secret is read when $COMMRT_JOB_SECRET is not set (``commrt
    launch`` sets a fresh one per job). Empty: ~/.config/commrt/job_secret, created (mode 0600)
    on first use, so all of one user's processes on this host share it and other users have none."""
    keys_dir: str = ""
    """For curve: the directory ``commrt keygen`` wrote (allow.txt and one .key per process).
    ``commrt launch`` makes a throw-away one for its job when this is empty."""
    allow_insecure: bool = False
    """Permit binding a non-loopback interface without encryption (none or secret mode; logged
    loudly): for a trusted fabric only."""

    def __post_init__(self) -> None:
        _check_choice("security", "mode", self.mode, SECURITY_MODES)


PS_MODES = ("sync", "async", "ssp")
PS_OPTIMIZERS = ("sgd", "adamw", "lamb")


@dataclass(frozen=True)
class PsConfig:
    servers: tuple[str, ...] = ()
    """One ``tcp://host:port`` per server shard; ``commrt server --index I`` serves entry I.
    In the environment: a comma-separated list."""
    workers: int = 0
    """How many workers push to the servers (the servers wait for all of them in sync mode)."""
    mode: str = "sync"
    """sync: apply step t once every worker pushed it; async: apply each push as it arrives;
    ssp: like async, but no worker may run more than ``staleness`` steps ahead of the slowest."""
    staleness: int = 0
    """The SSP bound s (ssp mode only)."""
    optimizer: str = "sgd"
    """Server-side optimizer: sgd | adamw | lamb."""
    lr: float = 0.01
    momentum: float = 0.0
    """SGD momentum (0 disables the buffer)."""
    nesterov: bool = False
    weight_decay: float = 0.0
    """SGD: L2 added to the gradient; AdamW and LAMB: decoupled decay."""
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    max_segment_bytes: int = 4 << 20
    """Tensors are split into key ranges of at most this many bytes (one frame each)."""
    timeout_s: float = 60.0
    """A server silent this long (no reply, no answer to a ping) is declared lost."""
    retry_s: float = 0.5
    """A client waiting on a reply pings the server this often; a restarted server answers
    'unknown' and the request is sent again (exactly-once makes that safe)."""
    worker_timeout_s: float = 30.0
    """How long a server waits for a lagging worker before applying ``on_worker_loss``."""
    on_worker_loss: str = "error"
    """error: waiting workers get PeerLost naming the missing worker; continue: drop it (logged)
    and go on with the rest."""
    checkpoint_dir: str = ""
    """Where servers keep their checkpoint and write-ahead log; empty disables durability."""
    checkpoint_every: int = 100
    """Updates between checkpoints (the write-ahead log covers the updates in between)."""
    max_log_bytes: int = 1 << 30
    """The log holds whole gradients (about a shard per update): once it grows past this many
    bytes the server checkpoints early, so its disk use stays near checkpoint + this bound."""
    fsync: bool = False
    """fsync the log before acknowledging (survives a machine crash, not only a process crash)."""
    metrics_port: int = 0
    """Serve Prometheus metrics (pushes, pulls, bytes, lag, SSP waits, apply latency) on this
    HTTP port (``commrt server --metrics-port``); 0: off."""
    metrics_addr: str = "127.0.0.1"
    """Where the metrics port binds: loopback unless set explicitly (the page is unauthenticated)."""

    def __post_init__(self) -> None:
        _check_choice("ps", "mode", self.mode, PS_MODES)
        _check_choice("ps", "optimizer", self.optimizer, PS_OPTIMIZERS)
        _check_choice("ps", "on_worker_loss", self.on_worker_loss, ("error", "continue"))
        for name in ("lr", "max_segment_bytes", "checkpoint_every", "max_log_bytes"):
            _check_positive("ps", name, getattr(self, name))
        for name in ("timeout_s", "retry_s", "worker_timeout_s"):
            _check_seconds("ps", name, getattr(self, name), MAX_TIMEOUT_S)
        for name in ("workers", "staleness", "momentum", "weight_decay", "eps"):
            if getattr(self, name) < 0:
                raise ConfigError(f"[ps] {name} = {getattr(self, name)!r} is invalid; must be >= 0")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"[ps] {name} = {getattr(self, name)!r} is invalid; must be in [0, 1)")
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"[ps] metrics_port = {self.metrics_port!r} is invalid; valid: 0 (off) to 65535")
        for addr in self.servers:
            if not addr.startswith("tcp://") or ":" not in addr[6:]:
                raise ConfigError(f"[ps] servers entry {addr!r} is invalid; expected 'tcp://host:port'")


QUANT_SCALE_DTYPES = ("fp32", "fp16")
QUANT_ROUNDINGS = ("nearest", "stochastic")


@dataclass(frozen=True)
class QuantConfig:
    block: int = 256
    """Elements per quantization scale in the int8/int4 collectives (``quant=``); an even
    number >= 2. Smaller blocks: smaller error, more scale bytes on the wire."""
    scale_dtype: str = "fp32"
    """fp32 | fp16: the dtype of the per-block scales (fp16 halves their bytes and refuses
    blocks whose scale would exceed 65504)."""
    rounding: str = "nearest"
    """nearest (error <= scale/2 per element) | stochastic (unbiased, error < scale)."""

    def __post_init__(self) -> None:
        if self.block < 2 or self.block % 2:
            raise ConfigError(f"[quant] block = {self.block!r} is invalid; it must be an even integer >= 2")
        _check_choice("quant", "scale_dtype", self.scale_dtype, QUANT_SCALE_DTYPES)
        _check_choice("quant", "rounding", self.rounding, QUANT_ROUNDINGS)


@dataclass(frozen=True)
class LogConfig:
    """Observability (commrt/obs): the comms log, the trace and the flight recorder."""
    comms: bool = False
    """Time and count every collective and point-to-point op by op, size bucket (powers of two),
    group and backend; ``commrt.comms_summary()`` returns the table and rank 0 logs it at exit.
    Off: one attribute check per op."""
    verbose: bool = False
    """With ``comms``: also log one JSON line per completed op (logger ``commrt.obs``)."""
    trace_file: str = ""
    """Write a Chrome/Perfetto trace (one track per rank, one thread per group) to this path;
    ``{rank}`` in it is replaced by the rank, else ``.rank<N>`` goes before the extension.
    ``commrt trace-merge OUT FILES...`` joins the ranks' files into one."""
    flight_dir: str = ""
    """Where every rank writes its flight record (``rank<N>.json``) on PeerLost,
    CollectiveMismatch, a CommTimeout or SIGUSR1; read with ``commrt flight-record DIR``.
    Empty: the ring buffers are still kept, but a dump goes nowhere (a line says so)."""
    flight_entries: int = 64
    """Ops each group's flight recorder keeps (a ring buffer; always on)."""

    def __post_init__(self) -> None:
        if not 1 <= self.flight_entries <= 1 << 20:
            raise ConfigError(f"[log] flight_entries = {self.flight_entries!r} is invalid; "
                              "it must be between 1 and 1048576")


@dataclass(frozen=True)
class Config:
    comm: CommConfig = field(default_factory=CommConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    ps: PsConfig = field(default_factory=PsConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def digest(self) -> str:
        """Hash of the settings every rank must agree on: what decides the algorithms and the
        wire, and the security mode. Not per-host ones (paths to the secret or keys, timeouts,
        memory habits): hosts that keep their keys in different places must still meet."""
        shared = {f"{s}.{n}": getattr(getattr(self, s), n) for s, n in DIGESTED}
        if self.quant != QuantConfig():  # ranks must decode each other's blocks alike
            shared["quant"] = dataclasses.asdict(self.quant)
        return hashlib.sha256(json.dumps(shared, sort_keys=True).encode()).hexdigest()[:16]


DIGESTED = (("comm", "backend"), ("comm", "chunk_bytes"), ("comm", "small_bytes"),
            ("comm", "max_frame_bytes"), ("comm", "check_call_sites"), ("comm", "hierarchical"),
            ("security", "mode"), ("comm", "intra_node"))


_SECTION_TYPES = {"comm": CommConfig, "cluster": ClusterConfig, "security": SecurityConfig,
                  "ps": PsConfig, "quant": QuantConfig}
_SECTION_TYPES["log"] = LogConfig
OTHER_SECTIONS = ("train",)  # read by their own layers (commrt/train/config.py)


def env_var(section: str, name: str) -> str:
    return f"COMMRT_{section.upper()}_{name.upper()}"


def env_table() -> list[tuple[str, str, str]]:
    """(variable, default, meaning) for every setting: the README's table is made from this."""
    rows = []
    for section, cls in _SECTION_TYPES.items():
        for f in dataclasses.fields(cls):
            rows.append((env_var(section, f.name), repr(f.default), f"[{section}] {f.name}"))
    return rows


def _coerce(section: str, name: str, typ: Any, value: Any) -> Any:
    if typing.get_origin(typ) is tuple:  # tuple[str, ...]: a TOML list or "a,b,c"
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"[{section}] {name} = {value!r} is invalid; expected a list of strings")
        return tuple(value)
    if isinstance(value, str) and typ is not str:
        text = value.strip().lower()
        if typ is bool:
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ConfigError(f"[{section}] {name} = {value!r} is invalid; valid: true/false")
        try:
            return typ(text)
        except ValueError:
            raise ConfigError(f"[{section}] {name} = {value!r} is invalid; expected {typ.__name__}") from None
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ConfigError(
            f"[{section}] {name} = {value!r} is invalid; expected {typ.__name__}, got {type(value).__name__}"
        )
    return value


def _section_from(section: str, raw: Mapping[str, Any]) -> Any:
    cls = _SECTION_TYPES[section]
    hints = typing.get_type_hints(cls)
    valid = [f.name for f in dataclasses.fields(cls)]
    values = {}
    for key, value in raw.items():
        if key not in hints:
            raise ConfigError(f"unknown key '{key}' in [{section}]; valid: {valid}")
        values[key] = _coerce(section, key, hints[key], value)
    return cls(**values)


def load_config(
    path: str | os.PathLike | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Build a Config from a TOML file, the environment and explicit overrides.

    ``path`` defaults to ``$COMMRT_CONFIG`` when set. ``[train]`` is left for its own layer; any
    other unknown section (a misspelling such as ``[comms]``) is an error.
    """
    environ = os.environ if environ is None else environ
    path = path or environ.get("COMMRT_CONFIG") or None
    merged: dict[str, dict[str, Any]] = {s: {} for s in _SECTION_TYPES}
    if path is not None:
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
        for section, body in data.items():
            if section not in _SECTION_TYPES and section not in OTHER_SECTIONS:
                raise ConfigError(f"{path}: unknown section [{section}]; valid: "
                                  f"{list(_SECTION_TYPES) + list(OTHER_SECTIONS)}")
            if section in _SECTION_TYPES:
                if not isinstance(body, dict):
                    raise ConfigError(f"[{section}] must be a table in {path}")
                merged[section].update(body)
    for section, cls in _SECTION_TYPES.items():
        for f in dataclasses.fields(cls):
            var = env_var(section, f.name)
            if var in environ:
                merged[section][f.name] = environ[var]
    for section, body in (overrides or {}).items():
        if section not in _SECTION_TYPES:
            raise ConfigError(f"unknown section '{section}'; valid: {list(_SECTION_TYPES)}")
        merged[section].update({k: v for k, v in body.items() if v is not None})
    return Config(**{s: _section_from(s, merged[s]) for s in _SECTION_TYPES})
