"""Chrome/Perfetto trace files: one process track per rank, one thread per group (and lanes
beside it for its ops that overlap without nesting, ``nest``).

The Trace Event Format (the JSON object form with ``traceEvents``), which ui.perfetto.dev and
chrome://tracing both open: "X" complete events (ts and dur in microseconds) and "M" metadata
events naming each track. Times are wall-clock microseconds, so the ranks of one host (and of
NTP-synchronised hosts) line up in a merged file.
"""
from __future__ import annotations

import contextlib
import errno
import glob
import json
import os
import re

REQUIRED = ("name", "ph", "ts", "pid", "tid")
_SENTINEL = 987654321  # stands for the rank while a template is turned into a pattern


TRAIN_TID = 1 << 20  # the track of a training engine's step spans, apart from the groups' (their ids)
LANE_SHIFT = 24
"""Lane N of track ``tid`` is thread ``tid | N << LANE_SHIFT`` (see ``nest``)."""


def rank_path(template: str, rank: int) -> str:
    """``{rank}`` replaced, or ``.rank<N>`` before the extension: one file per rank."""
    if "{rank}" in template:
        return template.replace("{rank}", str(rank))
    root, ext = os.path.splitext(template)
    return f"{root}.rank{rank}{ext or '.json'}"


def complete_event(name: str, rank: int, group: int, ts_us: float, dur_us: float, args: dict) -> dict:
    return {"name": name, "cat": "comm", "ph": "X", "ts": round(ts_us, 3), "dur": round(max(dur_us, 0.0), 3),
            "pid": rank, "tid": group, "args": args}


def track_names(rank: int, groups: dict[int, str]) -> list[dict]:
    """Metadata naming the rank's track and each group's thread, sorted by rank."""
    events = [{"name": "process_name", "ph": "M", "ts": 0, "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}},
              {"name": "process_sort_index", "ph": "M", "ts": 0, "pid": rank, "tid": 0, "args": {"sort_index": rank}}]
    for gid, label in sorted(groups.items()):
        events.append({"name": "thread_name", "ph": "M", "ts": 0, "pid": rank, "tid": gid, "args": {"name": label}})
    return events


def nest(events: list[dict], names: dict[int, str]) -> tuple[list[dict], dict[int, str]]:
    """One rank's "X" events, each on the first lane of its track (tid) where it nests, and
    ``names`` (tid -> track name) with the extra lanes named. The format requires the X events of
    one thread to nest, and Perfetto drops those that do not; a group's ops overlap without
    nesting when a sync op is issued behind queued async ones (its record starts at issue) or
    point-to-point ops complete out of order. Times compared in integer ns, as Perfetto does."""
    out, opened, lanes = [], {}, {}  # opened: (tid, lane) -> ends of the events still open there
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        start = round(e["ts"] * 1000)
        end, tid, lane = start + round(e["dur"] * 1000), e["tid"], 0
        while True:
            ends = opened.setdefault((tid, lane), [])
            while ends and ends[-1] <= start:
                ends.pop()
            if not ends or end <= ends[-1]:
                break
            lane += 1
        ends.append(end)
        if lane:
            e = {**e, "tid": tid | lane << LANE_SHIFT}
            lanes[tid] = max(lanes.get(tid, 0), lane)
        out.append(e)
    named = dict(names)
    for tid, most in lanes.items():
        for lane in range(1, most + 1):
            named[tid | lane << LANE_SHIFT] = f"{names.get(tid, f'track {tid}')}, overlapping ops {lane}"
    return out, named


def document(events: list[dict]) -> dict:
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def open_new(path: str):
    """``path`` created afresh for writing, never through a link: the temporary names of the
    atomic writes are predictable (pid, counter), and trace and flight files often go to /tmp,
    where another user could plant ``path`` as a symlink to a file of ours (open(path, "w")
    truncated and wrote it, and the rename then left the result a link to it)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except FileExistsError:  # a stale file of ours, or a planted link: unlink removes the name only
        os.unlink(path)
        fd = os.open(path, flags, 0o644)
    return os.fdopen(fd, "w")


def replace_with_json(path: str, tmp: str, value, **dump_kw) -> None:
    """``value`` as JSON at ``path`` (``replace_with``)."""
    replace_with(path, tmp, lambda fh: json.dump(value, fh, **dump_kw))


def replace_with(path: str, tmp: str, write_to) -> None:
    """What ``write_to(file)`` writes, at ``path``: written to ``tmp`` first and renamed (a reader
    never sees half a file). A write that fails (a full disk, EFBIG) removes ``tmp``: a partial
    file per failed dump would pile up in the very directory that ran out of space."""
    try:
        with open_new(tmp) as fh:
            write_to(fh)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.replace(tmp, path)


WRITE_CHUNK = 4096
"""Events encoded per json.dumps call by ``write``."""


def write(path: str, events: list[dict]) -> None:
    """Atomically: a reader (or a merge) never sees half a file. The events are encoded in
    chunks by ``json.dumps``, whose encoder is C; ``json.dump`` to a file runs the pure-Python
    one, 3x slower: 14.5 s for 200k events, past the 5 s between commrt launch's SIGTERM, which
    writes the trace, and its SIGKILL."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def write_to(fh) -> None:
        head = json.dumps(document([]))
        fh.write(head[:head.index("[") + 1])
        for i in range(0, len(events), WRITE_CHUNK):
            fh.write(("," if i else "") + json.dumps(events[i:i + WRITE_CHUNK])[1:-1])
        fh.write(head[head.index("]"):])
    replace_with(path, f"{path}.tmp{os.getpid()}", write_to)


def load(path: str) -> list[dict]:
    with open(path) as fh:
        data = json.load(fh)
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise ValueError(f"{path} is not a trace file (no traceEvents list)")
    return events


def merge(paths: list[str]) -> list[dict]:
    """Every rank's events in one list (their pids already differ: pid = rank)."""
    events: list[dict] = []
    for path in paths:
        events.extend(load(path))
    return events


def rank_files(pattern_or_files: list[str]) -> list[str]:
    """The per-rank files, given either the files or the configured trace_file template."""
    if len(pattern_or_files) != 1 or os.path.exists(pattern_or_files[0]):
        return list(pattern_or_files)
    # the rank may stand in the directories too (rank_path replaces every {rank}): glob the whole
    # path, then keep the paths whose every {rank} is the same number
    head, *rest = os.path.abspath(rank_path(pattern_or_files[0], _SENTINEL)).split(str(_SENTINEL))
    regex = re.compile(re.escape(head) + r"(?P<r>\d+)" + r"(?P=r)".join(map(re.escape, rest)) + r"\Z")
    found = sorted((int(m["r"]), p) for p in glob.glob("*".join(map(glob.escape, [head, *rest])))
                   if (m := regex.match(p)))
    if not found and not os.path.isdir(os.path.dirname(head)):  # say which directory is missing
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), os.path.dirname(head))
    return [p for _, p in found]
