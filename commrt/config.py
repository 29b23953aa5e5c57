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

from .errors import ConfigError

BACKEND_NAMES = ("auto", "zmq", "gloo", "nccl")


def _check_choice(section: str, name: str, value: Any, valid: tuple) -> None:
    if value not in valid:
        raise ConfigError(f"[{section}] {name} = {value!r} is invalid; valid: {list(valid)}")


def _check_positive(section: str, name: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"[{section}] {name} = {value!r} is invalid; it must be > 0")


@dataclass(frozen=True)
class CommConfig:
    backend: str = "auto"
    """Which backend runs the collectives: auto | zmq | gloo | nccl. ``auto`` picks NCCL when
    CUDA is usable and every local rank has its own GPU, else ZMQ."""
    timeout_s: float = 300.0
    """Deadline for every blocking wait (a receive, a send that cannot drain, init)."""
    chunk_bytes: int = 1 << 20
    """Payloads are pipelined in pieces of at most this many bytes (pyzmq slows down on very
    large single messages, and small pieces let send, receive and reduce overlap)."""
    small_bytes: int = 64 << 10
    """Tensors up to this size use latency-optimal algorithms (direct exchange) instead of the
    bandwidth-optimal ring."""
    max_frame_bytes: int = 64 << 20
    """Largest single frame a socket accepts (ZMQ_MAXMSGSIZE); must exceed chunk_bytes."""
    heartbeat_s: float = 1.0
    """ZMTP heartbeat interval: a peer silent for 3 intervals is declared lost."""

    def __post_init__(self) -> None:
        _check_choice("comm", "backend", self.backend, BACKEND_NAMES)
        for name in ("timeout_s", "chunk_bytes", "small_bytes", "max_frame_bytes", "heartbeat_s"):
            _check_positive("comm", name, getattr(self, name))
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


@dataclass(frozen=True)
class SecurityConfig:
    mode: str = "none"
    """Peer authentication on the data plane: none | curve."""
    allow_insecure: bool = False
    """Permit binding a non-loopback interface without authentication (logged loudly)."""

    def __post_init__(self) -> None:
        _check_choice("security", "mode", self.mode, ("none", "curve"))


@dataclass(frozen=True)
class Config:
    comm: CommConfig = field(default_factory=CommConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)

    def digest(self) -> str:
        """Hash of the settings every rank must agree on (not rank-specific ones)."""
        shared = {"comm": dataclasses.asdict(self.comm), "security": dataclasses.asdict(self.security)}
        return hashlib.sha256(json.dumps(shared, sort_keys=True).encode()).hexdigest()[:16]


_SECTION_TYPES = {"comm": CommConfig, "cluster": ClusterConfig, "security": SecurityConfig}


def env_var(section: str, name: str) -> str:
    return f"COMMRT_{section.upper()}_{name.upper()}"


def env_table() -> list[tuple[str, str, str]]:
    """(variable, default, meaning) for every setting: the README's table is made from this."""
    rows = []
    for section, cls in _SECTION_TYPES.items():
        for f in dataclasses.fields(cls):
            rows.append((env_var(section, f.name), repr(f.default), f"[{section}] {f.name}"))
    return rows


def _coerce(section: str, name: str, typ: type, value: Any) -> Any:
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

    ``path`` defaults to ``$COMMRT_CONFIG`` when set. Sections not belonging to the runtime
    (e.g. ``[train]``, ``[ps]``) are left for their own layers and ignored here.
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
