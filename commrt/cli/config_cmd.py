"""``commrt config [FILE]``: the dry run. Prints the whole effective config as TOML (every
section, ``[train]`` included), each value commented with its source (default, the file, an
environment variable), after validating every section; warns about ``COMMRT_*`` variables that
nothing reads (an error under ``--strict``). ``--env-table`` prints the README's variable table."""
from __future__ import annotations

import dataclasses
import os
import sys

from commrt.collectives.selection import format_table, table_from
from commrt.optim.schedules import PARAMS
from commrt.runtime.config import load_with_sources, markdown_env_table, read_file, unknown_variables
from commrt.runtime.config.render import section_lines
from commrt.runtime.config.comm import parse_algorithms
from commrt.runtime.errors import ConfigError


def add_parser(sub) -> None:
    cp = sub.add_parser("config", help="print the effective config as TOML, each value with its source",
                        description=__doc__)
    cp.add_argument("file", nargs="?", help="the TOML file; default: $COMMRT_CONFIG, else none (defaults and "
                    "environment only)")
    cp.add_argument("--env-table", action="store_true", help="print the environment variable table (Markdown)")
    cp.add_argument("--strict", action="store_true", help="an unknown COMMRT_* variable is an error, not a warning")
    cp.set_defaults(fn=run)


def run(args) -> int:
    if args.env_table:
        print(markdown_env_table())
        return 0
    unknown = unknown_variables(os.environ)
    for name in unknown:
        print(f"commrt config: {'error' if args.strict else 'warning'}: {name} is set but no setting reads it "
              "(misspelt? 'commrt config --env-table' lists them all)", file=sys.stderr)
    if unknown and args.strict:
        return 2
    path = args.file or os.environ.get("COMMRT_CONFIG") or None
    cfg, sources = load_with_sources(path)
    train_raw = read_file(path).get("train", {}) if path else {}
    try:
        from commrt.train.config import TrainConfig  # loads torch (optim): not for --help
        train = TrainConfig.from_dict(train_raw)
    except ConfigError as exc:
        raise ConfigError(f"[train] in {path}: {exc}") from None
    lines = [f"# commrt config{' ' + str(path) if path else ''}: the effective settings and where each came from"]
    for section in dataclasses.fields(cfg):
        values = getattr(cfg, section.name)
        lines += ["", *section_lines(section.name, [(f.name, getattr(values, f.name), sources[(section.name, f.name)])
                                                    for f in dataclasses.fields(values)])]
        if section.name == "comm":
            lines += _table_lines(cfg.comm.algorithms)
    lines += _train_lines(train, train_raw, f"file {path}")
    lines += ["", f"# digest {cfg.digest()} (what every rank must agree on)"]
    print("\n".join(lines))
    return 0


def _table_lines(algorithms: str) -> list[str]:
    """The selection table in force on the TCP path (``algorithms`` ahead of the defaults), as
    comments: which schedule runs a collective, by size and world size, first match wins."""
    rows = format_table(table_from(parse_algorithms(algorithms))).splitlines()
    return ["# selection table (first match wins; sizes: the bytes a rank holds at the end):",
            *(f"#   {row}" for row in rows)]


def _train_lines(train, raw: dict, from_file: str) -> list[str]:
    """``[train]`` in DeepSpeed's keys, as the file would write them."""
    def source(table: dict, key: str) -> str:
        return from_file if key in table else "default"
    zero_raw, opt_raw = raw.get("zero_optimization", {}), raw.get("optimizer", {})
    top = [("gradient_accumulation_steps", train.gradient_accumulation_steps),
           ("gradient_clipping", train.gradient_clipping), ("bf16", {"enabled": train.bf16}),
           ("non_finite_grads", train.non_finite_grads), ("manual_gc_interval", train.manual_gc_interval)]
    zero = [(f.name, getattr(train.zero, f.name)) for f in dataclasses.fields(train.zero)]
    zero = [(k, None if (k, v) == ("shard_group_size", 0) else v) for k, v in zero]  # 0: unset (a node)
    opt = train.optimizer
    params = {f.name: getattr(opt, f.name) for f in dataclasses.fields(opt) if f.name != "kind"}
    lines = ["", *section_lines("train", [(k, v, source(raw, k)) for k, v in top]),
             "", *section_lines("train.zero_optimization", [(k, v, source(zero_raw, k)) for k, v in zero]),
             "", *section_lines("train.optimizer", [("type", opt.kind, source(opt_raw, "type")),
                                                    ("params", params, source(opt_raw, "params"))])]
    if train.scheduler is not None:  # only its type's params (the others do not apply)
        sched, sched_raw = train.scheduler.as_dict(), raw.get("scheduler", {})
        kind = sched.pop("type")
        lines += ["", *section_lines("train.scheduler", [
            ("type", kind, source(sched_raw, "type")),
            ("params", {k: v for k, v in sched.items() if k in PARAMS[kind]}, source(sched_raw, "params"))])]
    return lines
