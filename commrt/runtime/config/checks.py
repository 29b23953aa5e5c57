"""Validation shared by every config section: each section's ``__post_init__`` calls these, so
a bad value is a ``ConfigError`` listing what is valid whether it came from a TOML file, the
environment, an argument or a ``Config(...)`` built in code."""
from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any

from commrt.runtime.errors import ConfigError

MAX_TIMEOUT_S = 1_000_000.0  # ~11.6 days; ZeroMQ takes timeouts as int32 milliseconds (~24.8 days)
MAX_HEARTBEAT_S = 3600.0  # 3 heartbeats (the timeout) in int32 milliseconds, with room to spare
MAX_BYTES = 1 << 62  # byte sizes end up in int64 socket options (ZMQ_MAXMSGSIZE) and offsets


class FieldError(ConfigError):
    """A ConfigError about one field: the loader adds where its value came from (file, variable)."""

    def __init__(self, section: str, name: str, message: str):
        super().__init__(message)
        self.section, self.name = section, name


def invalid(section: str, name: str, value: Any, why: str) -> FieldError:
    return FieldError(section, name, f"[{section}] {name} = {value!r} is invalid; {why}")


def check_types(section: str, obj: Any) -> None:
    """Every field holds its declared type: an int field refuses 1.5, True and "8" (the loader
    has already turned environment strings into their types), a float field takes an int."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        typ, value = hints[f.name], getattr(obj, f.name)
        if typing.get_origin(typ) is tuple:
            if not isinstance(value, (tuple, list)) or not all(isinstance(v, str) for v in value):
                raise invalid(section, f.name, value, "expected a list of strings")
            object.__setattr__(obj, f.name, tuple(value))  # frozen and hashable, even when given a list
            continue
        ok = isinstance(value, (int, float)) if typ is float else isinstance(value, typ)
        if not ok or (typ in (int, float) and isinstance(value, bool)):
            raise invalid(section, f.name, value, f"expected {_kind(typ)}, got {type(value).__name__}")


def _kind(typ: type) -> str:
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(typ, typ.__name__)


def check_choice(section: str, name: str, value: Any, valid: tuple) -> None:
    if value not in valid:
        raise invalid(section, name, value, f"valid: {list(valid)}")


def _finite(value: float) -> bool:
    return not isinstance(value, float) or math.isfinite(value)  # ints are; big ones overflow isfinite


def check_positive(section: str, name: str, value: float) -> None:
    """> 0 and finite (an infinite learning rate passed ``> 0``)."""
    if not (value > 0 and _finite(value)):
        raise invalid(section, name, value, "it must be > 0 and finite")


def check_non_negative(section: str, name: str, value: float) -> None:
    """>= 0 and finite: NaN fails every comparison, so ``value < 0`` let it through."""
    if not (value >= 0 and _finite(value)):
        raise invalid(section, name, value, "it must be >= 0 and finite")


def check_bytes(section: str, name: str, value: int) -> None:
    """A byte size: > 0 and within int64, where it ends up (2**70 failed in setsockopt, later)."""
    if not 0 < value <= MAX_BYTES:
        raise invalid(section, name, value, f"it must be > 0 and <= {MAX_BYTES} (2**62)")


def check_at_least(section: str, name: str, value: float, least: float) -> None:
    if not value >= least:
        raise invalid(section, name, value, f"must be >= {least}")


def check_seconds(section: str, name: str, value: float, most: float) -> None:
    """Durations become int32 milliseconds in socket options: bound them (inf and NaN fail)."""
    if not 0 < value <= most:
        raise invalid(section, name, value, f"it must be > 0 and <= {int(most)}")
