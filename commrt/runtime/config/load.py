"""Building a Config: the TOML file, then the environment (read here and nowhere else), then
explicit overrides, each value remembered with where it came from so an error can say so."""
from __future__ import annotations

import dataclasses
import os
import typing
from typing import Any, Mapping

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from commrt.runtime.config.checks import FieldError, invalid
from commrt.runtime.config.env import env_var
from commrt.runtime.config.tree import OTHER_SECTIONS, SECTION_TYPES, Config
from commrt.runtime.errors import ConfigError

DEFAULT = "default"
Sources = dict[tuple[str, str], str]
"""(section, field) -> "default", "file PATH", "environment NAME" or "argument"."""


def _coerce(section: str, name: str, typ: Any, value: Any) -> Any:
    """A TOML value or an environment string as the field's type; the section's checks do the rest."""
    if typing.get_origin(typ) is tuple:  # tuple[str, ...]: a TOML list or "a,b,c"
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise invalid(section, name, value, "expected a list of strings")
        return tuple(value)
    if isinstance(value, str) and typ is not str:
        text = value.strip().lower()
        if typ is bool:
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise invalid(section, name, value, "valid: true/false")
        try:
            return typ(text)
        except ValueError:
            raise invalid(section, name, value, f"expected {typ.__name__}") from None
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise invalid(section, name, value, f"expected {typ.__name__}, got {type(value).__name__}")
    return value


def _section_from(section: str, raw: Mapping[str, Any], sources: Sources) -> Any:
    cls = SECTION_TYPES[section]
    hints = typing.get_type_hints(cls)
    try:
        values = {}
        for key, value in raw.items():
            if key not in hints:
                raise ConfigError(f"unknown key '{key}' in [{section}]; valid: {[f.name for f in dataclasses.fields(cls)]}"
                                  f" ({_origin(sources.get((section, key), DEFAULT))})")
            values[key] = _coerce(section, key, hints[key], value)
        return cls(**values)
    except FieldError as exc:
        where = sources.get((exc.section, exc.name), DEFAULT)
        raise ConfigError(f"{exc} ({_origin(where)})") from None


def _origin(source: str) -> str:
    kind, _, what = source.partition(" ")
    return {"file": f"from the config file {what}", "environment": f"from the environment variable {what}",
            "argument": "from an argument", DEFAULT: "the default"}[kind]


def read_file(path: str | os.PathLike) -> dict[str, Any]:
    """The TOML file as a dict, or a ConfigError saying why not."""
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:  # TOML is UTF-8: a binary or Latin-1 file fails while decoding
        raise ConfigError(f"config file {path} is not valid TOML: not UTF-8 text ({exc})") from None


def _from_file(path, merged: dict, sources: Sources) -> None:
    for section, body in read_file(path).items():
        if section not in SECTION_TYPES and section not in OTHER_SECTIONS:
            raise ConfigError(f"{path}: unknown section [{section}]; valid: {list(SECTION_TYPES) + list(OTHER_SECTIONS)}")
        if not isinstance(body, dict):  # [train] too: its own layer reads it as a table
            raise ConfigError(f"[{section}] must be a table in {path}")
        if section in SECTION_TYPES:
            merged[section].update(body)
            sources.update({(section, k): f"file {path}" for k in body})


def load_with_sources(
    path: str | os.PathLike | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[Config, Sources]:
    """``load_config``, and where each setting's value came from."""
    environ = os.environ if environ is None else environ
    path = path or environ.get("COMMRT_CONFIG") or None
    merged: dict[str, dict[str, Any]] = {s: {} for s in SECTION_TYPES}
    sources: Sources = {(s, f.name): DEFAULT for s, cls in SECTION_TYPES.items() for f in dataclasses.fields(cls)}
    if path is not None:
        _from_file(path, merged, sources)
    for section, cls in SECTION_TYPES.items():
        for f in dataclasses.fields(cls):
            var = env_var(section, f.name)
            if var in environ:
                merged[section][f.name] = environ[var]
                sources[(section, f.name)] = f"environment {var}"
    for section, body in (overrides or {}).items():
        if section not in SECTION_TYPES:
            raise ConfigError(f"unknown section '{section}'; valid: {list(SECTION_TYPES)}")
        if not isinstance(body, Mapping):  # {"comm": "zmq"} died on .items()
            raise ConfigError(f"overrides['{section}'] must be a mapping of its settings, got {body!r:.60}")
        given = {k: v for k, v in body.items() if v is not None}
        merged[section].update(given)
        sources.update({(section, k): "argument" for k in given})
    return Config(**{s: _section_from(s, merged[s], sources) for s in SECTION_TYPES}), sources


def load_config(
    path: str | os.PathLike | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Build a Config from a TOML file, the environment and explicit overrides.

    ``path`` defaults to ``$COMMRT_CONFIG`` when set. ``[train]`` is left for its own layer; any
    other unknown section (a misspelling such as ``[comms]``) is an error.
    """
    return load_with_sources(path, overrides, environ)[0]
