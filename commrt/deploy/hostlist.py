"""Pure parsers of what schedulers and users write down about hosts.

- SLURM's compressed host lists (``SLURM_JOB_NODELIST=node[01-03,07],gpu5``), expanded as
  ``scontrol show hostnames`` does: ranges keep the zero padding of their lower bound, several
  bracket groups in one name multiply out (``r[1-2]n[1-2]`` -> r1n1 r1n2 r2n1 r2n2).
- SLURM's task counts per node (``SLURM_TASKS_PER_NODE=2(x3),1`` -> 2, 2, 2, 1).
- Host files for ``commrt launch --hosts``: one host a line, an optional ``slots=N``, ``#`` comments.
"""
from __future__ import annotations

import dataclasses
import re

from commrt.runtime.errors import ConfigError

MAX_HOSTS = 100_000  # a bound on expansion, so a typo like node[1-999999999] fails instead of eating memory
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
_COUNT = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")
_HOST = re.compile(r"^[A-Za-z0-9_.:@\-\[\]]+$")  # user@host, IPv6 in brackets


def _split_top(spec: str) -> list[str]:
    """Split on the commas that are outside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(spec):
        depth += (ch == "[") - (ch == "]")
        if depth not in (0, 1):
            raise ConfigError(f"host list {spec!r}: nested or unbalanced brackets")
        if ch == "," and depth == 0:
            items.append(spec[start:i])
            start = i + 1
    if depth:
        raise ConfigError(f"host list {spec!r}: a '[' is never closed")
    return items + [spec[start:]]


def _numbers(body: str, spec: str) -> list[str]:
    out: list[str] = []
    for part in body.split(","):
        m = _RANGE.match(part.strip())
        if not m:
            raise ConfigError(f"host list {spec!r}: {part!r} is not a number or a range like 01-03")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo) or len(out) + int(hi) - int(lo) >= MAX_HOSTS:
            raise ConfigError(f"host list {spec!r}: range {part!r} is reversed or too long")
        out += [str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1)]
    return out


def _expand_one(item: str, spec: str) -> list[str]:
    open_at = item.find("[")
    if open_at < 0:
        if "]" in item:
            raise ConfigError(f"host list {spec!r}: a ']' without its '['")
        return [item]
    close_at = item.index("]", open_at)
    head, body, tail = item[:open_at], item[open_at + 1:close_at], item[close_at + 1:]
    rest, numbers = _expand_one(tail, spec), _numbers(body, spec)
    if len(numbers) * len(rest) > MAX_HOSTS:  # each group is bounded alone: bound their product before building it
        raise ConfigError(f"host list {spec!r} names more than {MAX_HOSTS} hosts")
    return [head + n + r for n in numbers for r in rest]


def expand_hostlist(spec: str) -> list[str]:
    """``node[01-03,07],gpu5`` -> [node01, node02, node03, node07, gpu5] (``scontrol show hostnames``)."""
    spec = spec.strip()
    if not spec:
        raise ConfigError("the host list is empty")
    hosts: list[str] = []
    for item in _split_top(spec):
        if not item.strip():
            raise ConfigError(f"host list {spec!r} has an empty entry")
        hosts += _expand_one(item.strip(), spec)
        if len(hosts) > MAX_HOSTS:
            raise ConfigError(f"host list {spec!r} names more than {MAX_HOSTS} hosts")
    return hosts


def tasks_per_node(spec: str) -> list[int]:
    """SLURM_TASKS_PER_NODE (``2(x3),1``) -> one count per node of the step: [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in spec.split(","):
        m = _COUNT.match(part.strip())
        if not m:
            raise ConfigError(f"SLURM_TASKS_PER_NODE={spec!r}: {part!r} is not N or N(xK)")
        repeat = int(m.group(2) or 1)
        if len(counts) + repeat > MAX_HOSTS:  # 2(x99999999999) would build the list first
            raise ConfigError(f"SLURM_TASKS_PER_NODE={spec!r} counts more than {MAX_HOSTS} nodes")
        counts += [int(m.group(1))] * repeat
    return counts


@dataclasses.dataclass(frozen=True)
class Host:
    name: str
    """What ssh is given (``user@host`` or an alias from ~/.ssh/config)."""
    slots: int | None
    """Ranks on this host; None: the launch's ``-n``."""


def parse_hostfile(text: str) -> list[Host]:
    """One host a line, ``host [slots=N]``; blank lines and ``#`` comments are skipped."""
    hosts = []
    for number, raw in enumerate(text.splitlines(), 1):
        words = raw.split("#", 1)[0].split()
        if not words:
            continue
        slots = None
        for word in words[1:]:
            key, _, value = word.partition("=")
            if key != "slots" or not value.isdecimal() or int(value) < 1:  # isdigit() takes "²", which int() refuses
                raise ConfigError(f"host file line {number}: {word!r} is invalid; expected 'slots=N' (N >= 1)")
            slots = int(value)
        if not _HOST.match(words[0]) or words[0].startswith("-"):
            raise ConfigError(f"host file line {number}: {words[0]!r} is not a host name")
        hosts.append(Host(words[0], slots))
    if not hosts:
        raise ConfigError("the host file names no hosts")
    return hosts
