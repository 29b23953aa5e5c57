"""Which schedule runs a collective, by message size and world size (issue 32.1): a table as data.

The defaults follow MPICH's and NCCL's tuning, adjusted with ``commrt.plan.simulate`` (see
docs/PERFORMANCE.md, "Latency-optimal schedules"): recursive doubling while a message's
latency dominates (log2 n messages instead of the ring's 2 (n-1)), Rabenseifner from 16 KiB
(the ring's bytes in 2 log2 n steps: doubling's whole-buffer exchanges already queue 8 ranks
on one NIC at 64 KiB), the ring above 32 MiB, where its neighbour-only traffic crossing each
NIC once per step beats Rabenseifner's long-distance steps that push every rank of a node
through the NIC at once (simulated at 1,024 ranks: 7.2 ms against 11.0 ms at 64 MiB). ``nbytes`` is the buffer a rank holds at the end
(all_gather: the gathered output; all_to_all: the input).

``table_from(overrides)`` puts rules from a dict (``[comm] algorithms``, parsed by
``runtime.config.comm.parse_algorithms``; the TCP path's backend builds its table so) in front of
the defaults: ``{"all_reduce": "ring"}`` pins an algorithm for every size, and
``{"all_reduce": [{"algorithm": "ring", "min_bytes": 0, "max_bytes": 65536}]}`` pins it for a
range (``min_world``/``max_world`` too). Unknown collectives, algorithms or keys raise
``ConfigError`` listing what is valid.
"""
from __future__ import annotations

from typing import NamedTuple

from commrt.collectives.schedules import ALGORITHMS
from commrt.runtime.errors import ConfigError


class Rule(NamedTuple):
    collective: str
    algorithm: str
    min_bytes: int = 0
    max_bytes: int | None = None    # exclusive; None: unbounded
    min_world: int = 1
    max_world: int | None = None    # inclusive; None: unbounded

    def matches(self, collective: str, nbytes: int, world: int) -> bool:
        return (collective == self.collective and self.min_bytes <= nbytes
                and (self.max_bytes is None or nbytes < self.max_bytes)
                and self.min_world <= world and (self.max_world is None or world <= self.max_world))


KiB, MiB = 1 << 10, 1 << 20
DEFAULT_TABLE: tuple[Rule, ...] = (
    # two ranks: Rabenseifner is the ring (two half-buffer exchanges), doubling one whole-buffer
    # exchange, which won to 512 KiB over loopback (1 MiB: the halves' overlap wins; PERFORMANCE.md)
    Rule("all_reduce", "recursive_doubling", max_bytes=1 * MiB, max_world=2),
    Rule("all_reduce", "recursive_doubling", max_bytes=16 * KiB),
    Rule("all_reduce", "rabenseifner", max_bytes=32 * MiB),
    Rule("all_reduce", "ring"),
    Rule("broadcast", "binomial", max_bytes=512 * KiB),
    Rule("broadcast", "chain"),
    Rule("reduce", "binomial", max_bytes=512 * KiB),
    Rule("reduce", "ring"),
    Rule("all_gather", "bruck", max_bytes=256 * KiB),
    Rule("all_gather", "ring"),
    Rule("all_to_all", "pairwise"),
    Rule("barrier", "dissemination"),
)
_RANGE_KEYS = ("min_bytes", "max_bytes", "min_world", "max_world")


def choose(collective: str, nbytes: int, world: int, table: tuple[Rule, ...] = DEFAULT_TABLE) -> str:
    """The first rule of ``table`` matching; ConfigError if none does (a table with a gap)."""
    for rule in table:
        if rule.matches(collective, nbytes, world):
            return rule.algorithm
    raise ConfigError(f"no algorithm for {collective} of {nbytes} B over {world} ranks in the table; "
                      f"collectives: {sorted(ALGORITHMS)}")


def _rule(collective: str, entry) -> Rule:
    if isinstance(entry, str):
        entry = {"algorithm": entry}
    if not isinstance(entry, dict):
        raise ConfigError(f"[comm] algorithm for {collective}: expected a name or a table, got {entry!r}")
    unknown = set(entry) - {"algorithm", *_RANGE_KEYS}
    if unknown:
        raise ConfigError(f"[comm] algorithm for {collective}: unknown keys {sorted(unknown)}; "
                          f"valid: {['algorithm', *_RANGE_KEYS]}")
    algo = entry.get("algorithm")
    if algo not in ALGORITHMS[collective]:
        raise ConfigError(f"[comm] unknown algorithm {algo!r} for {collective}; "
                          f"valid: {sorted(ALGORITHMS[collective])}")
    rng = {k: entry[k] for k in _RANGE_KEYS if entry.get(k) is not None}
    if any(not isinstance(v, int) or v < 0 for v in rng.values()):
        raise ConfigError(f"[comm] algorithm for {collective}: {rng} must be non-negative integers")
    rule = Rule(collective, algo, **rng)
    if (rule.max_bytes is not None and rule.max_bytes <= rule.min_bytes) or \
            (rule.max_world is not None and rule.max_world < rule.min_world):
        # a rule no op can match: pinned, yet never run (max_bytes is exclusive, max_world inclusive)
        raise ConfigError(f"[comm] algorithm {algo} for {collective}: the range {rng} is empty "
                          f"(bytes in [min_bytes, max_bytes), ranks in [min_world, max_world])")
    return rule


def table_from(overrides: dict | None, base: tuple[Rule, ...] = DEFAULT_TABLE) -> tuple[Rule, ...]:
    """``overrides`` (collective -> name, or list of {algorithm, ranges}) ahead of ``base``."""
    rules = []
    for collective, value in (overrides or {}).items():
        if collective not in ALGORITHMS:
            raise ConfigError(f"[comm] unknown collective {collective!r}; valid: {sorted(ALGORITHMS)}")
        rules += [_rule(collective, e) for e in (value if isinstance(value, list) else [value])]
    return (*rules, *base)


def _size(n: int | None) -> str:
    if n is None:
        return "inf"
    return next((f"{n // s} {u}" for s, u in ((MiB, "MiB"), (KiB, "KiB")) if n >= s and n % s == 0), f"{n} B")


def format_table(table: tuple[Rule, ...] = DEFAULT_TABLE) -> str:
    """One line per rule, first match wins (for ``commrt config``)."""
    return "\n".join(f"{r.collective:<11} [{_size(r.min_bytes)}, {_size(r.max_bytes)})  "
                     f"ranks {r.min_world}..{r.max_world or 'inf'}  {r.algorithm}" for r in table)
