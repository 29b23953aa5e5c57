"""``commrt flight-record DIR``: what the ranks' flight records say happened (pure).

Three findings, per group, from the collectives' sequence numbers (the same ``seq`` is the same
collective on every member):
- absent: a member left no record. It died (or never saw an error: a rank that skipped a
  collective and went on) while the others waited in the collective they had entered.
- behind: a rank whose last collective is older than the newest one the others entered is
  missing from the one after its last (the lowest last-seq ranks).
- mismatch: at one seq, ranks disagree on op, size or dtype (not on size for all_to_all_single,
  whose split sizes differ per rank by design); the ranks outside the largest agreeing set are
  named (with two ranks, both).
"""
from __future__ import annotations

import collections
import dataclasses


@dataclasses.dataclass(frozen=True)
class Finding:
    kind: str  # absent | behind | mismatch
    group: int
    rank: int
    """The global rank to blame."""
    seq: int
    op: str
    """The newest collective the others entered (absent), the first one this rank missed
    (behind) or the one this rank ran (mismatch)."""
    detail: str


# collectives whose size differs per rank by design: all_to_all_single with split sizes (each
# rank sends what it routes); they are compared by op and dtype only
SIZED_PER_RANK = ("all_to_all_single",)


def _sig(entry: dict) -> tuple:
    return entry["op"], None if entry["op"] in SIZED_PER_RANK else entry["nbytes"], entry["dtype"]


def _show(sig: tuple) -> str:
    return f"{sig[0]} {sig[2]}" if sig[1] is None else f"{sig[0]} {sig[1]} B {sig[2]}"


def _describe(entry: dict | None) -> str:
    if entry is None:
        return "nothing recorded"
    return f"seq {entry['seq']} {entry['op']} {entry['nbytes']} B {entry['dtype']} ({entry['state']})"


def _collectives(group: dict) -> dict[int, dict]:
    return {e["seq"]: e for e in group["entries"] if e["kind"] == "coll"}


def _groups(dumps: list[dict]) -> dict[int, dict]:
    """gid -> {"ranks": members, "by_rank": {global rank: the group's dict in its dump}}."""
    out: dict[int, dict] = {}
    for d in dumps:
        for g in d["groups"]:
            entry = out.setdefault(g["id"], {"ranks": g["ranks"], "by_rank": {}})
            entry["by_rank"][d["rank"]] = g
    return out


def _mismatches(gid: int, by_rank: dict[int, dict]) -> list[Finding]:
    colls = {r: _collectives(g) for r, g in by_rank.items()}
    found = []
    for seq in sorted({s for c in colls.values() for s in c}):
        sigs = {r: _sig(c[seq]) for r, c in colls.items() if seq in c}
        kinds = collections.Counter(sigs.values())
        if len(kinds) < 2:
            continue
        top = kinds.most_common()
        majority = top[0][0] if top[0][1] > top[1][1] else None  # a tie blames every side
        for r, sig in sorted(sigs.items()):
            if sig != majority:
                others = sorted({s for s in sigs.values() if s != sig})
                found.append(Finding("mismatch", gid, r, seq, sig[0], f"rank {r} runs {_show(sig)} at seq {seq}; "
                                     "others run " + ", ".join(_show(o) for o in others)))
    return found


def _stragglers(gid: int, ranks: list[int], by_rank: dict[int, dict], present: set[int]) -> list[Finding]:
    last = {r: g["last_seq"] for r, g in by_rank.items()}
    last.update({r: 0 for r in ranks if r in present and r not in by_rank})  # no op on this group yet
    if not last:
        return []
    newest = max(last.values())
    leaders = sorted(r for r, s in last.items() if s == newest)
    entered = next((_collectives(by_rank[r]).get(newest) for r in leaders), None)
    op = entered["op"] if entered else "?"
    found = []
    for r in ranks:
        if r not in last:
            found.append(Finding("absent", gid, r, newest, op,
                                 f"rank {r} left no flight record (it died, or went on without an error); "
                                 f"ranks {leaders} stopped in {_describe(entered)}"))
        elif last[r] < newest:
            # the collective it missed is the one after its last, not the newest: async ops let
            # the others issue several past a stuck rank
            missed = _entered(by_rank, last[r] + 1)
            ahead = sorted(x for x, s in last.items() if s > last[r])
            mine = _collectives(by_rank[r]).get(last[r]) if r in by_rank else None
            name = missed["op"] if missed else "?"
            found.append(Finding("behind", gid, r, last[r] + 1, name,
                                 f"rank {r} never entered seq {last[r] + 1} ({name}) that ranks {ahead} "
                                 f"entered; its last: {_describe(mine)}"))
    return found


def _entered(by_rank: dict[int, dict], seq: int) -> dict | None:
    """Some rank's record of collective ``seq`` (None when every ring has moved past it)."""
    return next((e for g in by_rank.values() if (e := _collectives(g).get(seq)) is not None), None)


def _newest_job(dumps: list[dict]) -> tuple[list[dict], list[int]]:
    """The dumps of the job that wrote the latest one, and the ranks of the others' (stale files
    of an earlier run in a reused flight_dir: counted, they blamed the ranks of this one)."""
    if len({d.get("job") for d in dumps}) < 2:
        return dumps, []
    when = lambda d: d["time"] if isinstance(d.get("time"), (int, float)) else 0.0  # noqa: E731
    job = max(dumps, key=when).get("job")
    return [d for d in dumps if d.get("job") == job], sorted(d["rank"] for d in dumps if d.get("job") != job)


def analyze(dumps: list[dict], world_size: int | None = None) -> tuple[list[Finding], list[str]]:
    """(findings, report lines). ``world_size``: if known, ranks with no dump at all count too."""
    dumps, stale = _newest_job(dumps)
    world = world_size or max((d.get("world_size", 0) for d in dumps), default=0)
    present = sorted(d["rank"] for d in dumps)
    lines = [f"flight records of ranks {present} (world size {world})"]
    if stale:
        lines.append(f"left out the records of ranks {stale}: written by another job (an earlier run)")
    missing = sorted(set(range(world)) - set(present))
    if missing:
        lines.append(f"no record from ranks {missing}")
    findings: list[Finding] = []
    for gid, g in sorted(_groups(dumps).items()):
        by_rank = g["by_rank"]
        lines.append(f"group {gid} (ranks {g['ranks']}):")
        for r in sorted(by_rank):
            colls = _collectives(by_rank[r])
            last = colls.get(by_rank[r]["last_seq"])
            lines.append(f"  rank {r} stopped at {_describe(last)}"
                         + (f": {last['error']}" if last and last.get("error") else ""))
            lines += [f"    pending p2p: {e['op']} peer {e['peer']} {e['nbytes']} B ({e['state']})"
                      for e in by_rank[r]["entries"] if e["kind"] == "p2p" and e["state"] != "completed"]
        group_findings = _mismatches(gid, by_rank) + _stragglers(gid, g["ranks"], by_rank, set(present))
        lines += [f"  -> {f.detail}" for f in group_findings]
        findings += group_findings
    if not findings:
        lines.append("no rank is missing or disagrees in the recorded window")
    return findings, lines
