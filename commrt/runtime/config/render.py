"""A config section as TOML text, each value commented with where it came from."""
from __future__ import annotations

import json
import math
from typing import Any, Iterable, Mapping


def toml_value(value: Any) -> str:
    """``value`` as a TOML literal (tuples and lists as arrays, dicts as inline tables)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return ("nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")) if not math.isfinite(value) else repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return _basic_string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{ " + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"no TOML form for {type(value).__name__}")


def _basic_string(text: str) -> str:
    """A TOML basic string, in ASCII. JSON's escapes are TOML's, except that json.dumps writes a
    character beyond U+FFFF as a UTF-16 surrogate pair, which TOML refuses: it gets \\UXXXXXXXX."""
    body = json.dumps(text, ensure_ascii=False)  # quotes, backslashes and control characters escaped
    return "".join(c if ord(c) < 0x7F else f"\\u{ord(c):04X}" if ord(c) <= 0xFFFF else f"\\U{ord(c):08X}"
                   for c in body)


def section_lines(name: str, items: Iterable[tuple[str, Any, str]]) -> list[str]:
    """``[name]`` and one ``key = value  # source`` line per item; a None value (unset: TOML
    has no null) becomes a commented line."""
    lines = [f"[{name}]"]
    for key, value, source in items:
        if value is None:
            lines.append(f"# {key} is unset  # {source}")
        else:
            lines.append(f"{key} = {toml_value(value)}  # {source}")
    return lines
