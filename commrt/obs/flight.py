"""The flight recorder: each group's last N ops in a ring buffer, dumped as JSON when things go wrong.

Like PyTorch's NCCL flight recorder, for every backend. Collectives and point-to-point ops are
numbered apart (``seq`` and ``p2p_seq``), as torch does: every member issues a group's
collectives in the same order, so the same ``seq`` names the same collective on every rank,
while point-to-point traffic differs per rank. ``seq`` counts the ops issued through the public
API on this group (the init barrier and group set-up are not among them).
"""
from __future__ import annotations

import itertools
import json
import os
import threading
import time

from commrt.obs.trace import replace_with_json

QUEUED, STARTED, COMPLETED, FAILED = "queued", "started", "completed", "failed"
VERSION = 1
_TMP_IDS = itertools.count()  # a dump from a signal handler may interrupt one in progress


class Record:
    """One op. Allocated once per op; everything else of the recorder is preallocated."""
    __slots__ = ("ring", "seq", "p2p", "op", "nbytes", "dtype", "peer", "state", "issued", "started",
                 "ended", "error", "__weakref__")

    def __init__(self, ring: "GroupRing", seq: int, p2p: bool, op: str, nbytes: int, dtype, peer: int,
                 state: str, now: float):
        self.ring, self.seq, self.p2p, self.op, self.nbytes = ring, seq, p2p, op, nbytes
        self.dtype, self.peer, self.state, self.issued = dtype, peer, state, now
        self.started = now if state == STARTED else None
        self.ended = None
        self.error = None

    def start(self) -> None:
        """The group's executor gave this queued op its turn."""
        if self.state == QUEUED:
            self.state, self.started = STARTED, time.perf_counter()

    def turn(self) -> None:
        """A sync op got its group's turn (runtime/work.on_turn): it starts now, not at issue,
        when async ops were queued before it (their time is not its own)."""
        if self.state == STARTED:
            self.started = time.perf_counter()

    def done(self, error: BaseException | None, at: float | None = None) -> None:
        """An async op completed or failed (``Work._finish``); exactly once even when that
        races with the op's registration (``Observer.issued``). ``at``: when it ended, where
        that was seen before (a torch future's callback: ``Work._ended_at``); else now."""
        with self.ring.lock:
            if self.ended is not None:
                return
            self.ended = time.perf_counter() if at is None else at
        self._end(error)

    def end(self, error: BaseException | None) -> None:
        """A sync op returned or raised, in the caller's thread: nothing else can end it."""
        self.ended = time.perf_counter()
        if error is None:  # _end's common case inline: on the path of every op
            self.state = COMPLETED
            self.ring.observer.completed(self, None)
        else:
            self._end(error)

    def _end(self, error: BaseException | None) -> None:
        if error is None:
            self.state = COMPLETED
        else:
            self.state, self.error = FAILED, f"{type(error).__name__}: {error}"
        self.ring.observer.completed(self, error)

    def timed_out(self, error: BaseException) -> None:
        """``Work.wait(timeout)`` gave up: the op is still pending, but the rank may be stuck."""
        self.ring.observer.dump(f"{type(error).__name__}: {error}")

    def as_dict(self, wall0: float) -> dict:
        wall = lambda t: None if t is None else round(t + wall0, 6)
        return {"seq": self.seq, "kind": "p2p" if self.p2p else "coll", "op": self.op, "nbytes": self.nbytes,
                "dtype": str(self.dtype).replace("torch.", ""), "peer": self.peer, "state": self.state,
                "issued": wall(self.issued), "started": wall(self.started), "ended": wall(self.ended),
                "error": self.error}


class GroupRing:
    """One group's ring buffer of its last ``size`` records, and its counters."""

    def __init__(self, observer, gid: int, ranks: tuple[int, ...], rank: int, backend: str, size: int):
        self.observer, self.gid, self.ranks, self.rank, self.backend = observer, gid, ranks, rank, backend
        self.slots: list[Record | None] = [None] * size
        self.issued = 0  # ops recorded (the next one goes to slots[issued % size])
        self.seq = 0  # collectives issued
        self.p2p_seq = 0  # point-to-point ops issued
        self.lock = threading.Lock()

    def add(self, p2p: bool, op: str, nbytes: int, dtype, peer: int, state: str) -> Record:
        if p2p:
            self.p2p_seq += 1
            seq = self.p2p_seq
        else:
            self.seq += 1
            seq = self.seq
        rec = Record(self, seq, p2p, op, nbytes, dtype, peer, state, time.perf_counter())
        slots = self.slots
        slots[self.issued % len(slots)] = rec
        self.issued += 1
        return rec

    def entries(self) -> list[Record]:
        """Oldest first."""
        n, size = self.issued, len(self.slots)
        order = [self.slots[i % size] for i in range(max(0, n - size), n)]
        return [r for r in order if r is not None]

    def as_dict(self, wall0: float) -> dict:
        return {"id": self.gid, "ranks": list(self.ranks), "rank": self.rank, "backend": self.backend,
                "last_seq": self.seq, "last_p2p_seq": self.p2p_seq,
                "entries": [r.as_dict(wall0) for r in self.entries()]}


def snapshot(rank: int, world_size: int, reason: str, rings: list[GroupRing], wall0: float,
             job: int | None = None) -> dict:
    """A rank's dump: what ``commrt flight-record`` reads. ``job``: the same on every rank of one
    run and not the next's (the bootstrap store's incarnation), so a stale record of an earlier
    run in the same directory is told apart; None where unknown."""
    return {"version": VERSION, "rank": rank, "world_size": world_size, "job": job, "pid": os.getpid(),
            "host": os.uname().nodename, "time": round(time.time(), 6), "reason": reason,
            "groups": [g.as_dict(wall0) for g in rings]}


def dump_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank{rank}.json")


def write_dump(directory: str, dump: dict) -> str:
    """Atomically (a reader never sees half a dump); a later dump of the same rank replaces it."""
    os.makedirs(directory, exist_ok=True)
    path = dump_path(directory, dump["rank"])
    replace_with_json(path, f"{path}.tmp{os.getpid()}.{next(_TMP_IDS)}", dump, indent=1)
    return path


def read_dumps(directory: str) -> list[dict]:
    """Every ``rank*.json`` in ``directory`` (ValueError naming a file that is not a dump)."""
    dumps = []
    for name in sorted(os.listdir(directory)):
        if not (name.startswith("rank") and name.endswith(".json")):
            continue
        path = os.path.join(directory, name)
        try:
            with open(path) as fh:
                data = json.load(fh)
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: not a readable flight record ({exc})") from None
        if not isinstance(data, dict) or data.get("version") != VERSION or "groups" not in data:
            raise ValueError(f"{path}: not a commrt flight record (version {VERSION})")
        problem = _malformed(data)
        if problem:
            raise ValueError(f"{path}: not a complete commrt flight record ({problem})")
        dumps.append(data)
    return dumps


GROUP_FIELDS = {"id": int, "ranks": list, "last_seq": int, "entries": list}
ENTRY_FIELDS = {"seq": int, "kind": str, "op": str, "nbytes": int, "dtype": str, "state": str}


def _malformed(data: dict) -> str:
    """What the analysis would miss in ``data`` ('' if nothing): it indexes these fields, and a
    KeyError from deep inside it named neither the file nor the field."""
    if type(data.get("rank")) is not int or not isinstance(data["groups"], list):
        return "'rank' must be an integer and 'groups' a list"
    for g in data["groups"]:
        if not isinstance(g, dict) or any(not isinstance(g.get(k), t) for k, t in GROUP_FIELDS.items()):
            return f"a group needs {sorted(GROUP_FIELDS)}"
        for e in g["entries"]:
            if not isinstance(e, dict) or any(not isinstance(e.get(k), t) for k, t in ENTRY_FIELDS.items()):
                return f"group {g['id']}: an entry needs {sorted(ENTRY_FIELDS)}"
    return ""
