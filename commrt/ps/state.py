"""What one server shard holds: its segments' values, optimizer state, and who pushed what.

No sockets here: the request logic (``core``) and recovery (checkpoint + log replay) both call
``apply`` and ``record``, so a replayed run performs exactly the arithmetic of the original.
Values and optimizer state are numpy arrays, stepped by ``optim/numpy_rules.py``: a shard never
imports torch.
"""
from __future__ import annotations

import collections
from typing import NamedTuple

import numpy as np

from commrt.optim import numpy_rules as optim
from commrt.optim.spec import OptimSpec, state_names, trust_ratio
from commrt.ps.durable import NUMPY_DTYPES, load_checkpoint, save_checkpoint

RECENT = 64  # per-worker applied steps remembered for de-duplicating re-sent pushes
MAX_AHEAD = 8  # pushes a worker may have in flight beyond its next step
# staleness histogram: gaps of MAX_GAP or more share the last key. Async waits for nobody, so an
# idle worker holds the slowest clock and every update would open a key of its own; a STATS reply
# (a msgpack map) must stay within the client's limits
MAX_GAP = 1024
FLOAT_CODES = (1, 2)  # float32, float64: the server keeps full-precision master values


class SegInfo(NamedTuple):
    name: str
    start: int
    stop: int
    dtype: int

    @property
    def numel(self) -> int:
        return self.stop - self.start

    @property
    def nbytes(self) -> int:
        return self.numel * NUMPY_DTYPES[self.dtype].itemsize


class ShardState:
    def __init__(self, spec: OptimSpec, workers: int):
        self.spec, self.workers = spec, workers
        self.segs: list[SegInfo] = []
        self.shapes: dict[str, tuple[int, ...]] | None = None  # None: from a checkpoint without them
        self.params: list[np.ndarray] = []
        self.opt: list[dict[str, np.ndarray]] = []
        self.steps: list[int] = []  # updates applied to each segment (Adam's t)
        self.version = 0
        self.clocks = [0] * workers
        self.recent = [collections.deque(maxlen=RECENT) for _ in range(workers)]
        self.dropped: set[int] = set()  # members dropped after they went silent
        self.late: set[int] = set()  # late joiners ([ps] initial_workers) not admitted yet
        self.joined: set[int] = set()  # workers whose init matched the seed: only they may push/pull
        self.staleness: collections.Counter = collections.Counter()
        self._seeded = False

    @property
    def initialized(self) -> bool:
        """Seeded (or loaded); a shard may hold no segment at all (fewer keys than shards)."""
        return self._seeded

    def active(self) -> list[int]:
        """The members: the workers this shard counts (sync steps, the SSP bound, laggards)."""
        return [w for w in range(self.workers) if w not in self.dropped and w not in self.late]

    def admit(self, worker: int, clock: int) -> None:
        """Make ``worker`` a member from step ``clock`` on (never below its own clock: the
        steps it already pushed here stay applied once)."""
        self.dropped.discard(worker)
        self.late.discard(worker)
        self.clocks[worker] = max(self.clocks[worker], clock)

    def min_clock(self) -> int:
        live = [self.clocks[w] for w in self.active()]
        return min(live) if live else max(self.clocks)

    def seed(self, segs: list[SegInfo], values: list[np.ndarray],
             shapes: dict[str, tuple[int, ...]] | None = None) -> None:
        self.segs, self.shapes = list(segs), shapes
        self.params = [v.copy() for v in values]
        self.opt = [optim.init_state(self.spec, p) for p in self.params]
        self.steps = [0] * len(segs)
        self._seeded = True

    def apply(self, ids: list[int], grads: list[np.ndarray]) -> None:
        """One optimizer update of the given segments (LAMB: norms per whole tensor)."""
        for i in ids:
            self.steps[i] += 1
        if self.spec.kind != "lamb":
            for i, g in zip(ids, grads):
                optim.step_(self.params[i], g, self.opt[i], self.spec, self.steps[i])
            return
        by_name: dict[str, list[tuple[int, np.ndarray]]] = collections.defaultdict(list)
        for i, g in zip(ids, grads):
            r = optim.lamb_direction_(self.params[i], g, self.opt[i], self.spec, self.steps[i])
            by_name[self.segs[i].name].append((i, r))
        for parts in by_name.values():
            w_norm = sum(optim.sum_sq(self.params[i]) for i, _ in parts) ** 0.5
            r_norm = sum(optim.sum_sq(r) for _, r in parts) ** 0.5
            trust = trust_ratio(w_norm, r_norm)
            for i, r in parts:
                optim.lamb_apply_(self.params[i], r, trust, self.spec)

    def record(self, contributions: list[tuple[int, int]], gap: int | None = None) -> None:
        """Mark (worker, step) pushes as applied; one more version."""
        for w, step in contributions:
            self.clocks[w] = step + 1
            self.recent[w].append(step)
        self.version += 1
        if gap is not None:
            self.staleness[min(gap, MAX_GAP)] += 1

    # -- persistence ------------------------------------------------------------------------
    def save(self, path: str) -> None:
        names = state_names(self.spec)
        arrays = self.params + [o[n] for o in self.opt for n in names]
        codes = [s.dtype for s in self.segs] + [s.dtype for s in self.segs for _ in names]
        meta = {"segs": [list(s) for s in self.segs], "steps": self.steps, "version": self.version,
                "clocks": self.clocks, "recent": [list(r) for r in self.recent],
                "dropped": sorted(self.dropped), "late": sorted(self.late), "joined": sorted(self.joined), "optimizer": self.spec.kind,
                "shapes": None if self.shapes is None else [[k, list(v)] for k, v in self.shapes.items()],
                "staleness": {str(k): v for k, v in self.staleness.items()}}
        save_checkpoint(path, meta, arrays, codes)

    def load(self, path: str) -> None:
        meta, arrays = load_checkpoint(path)
        if meta.get("optimizer") != self.spec.kind or len(meta.get("clocks", [])) != self.workers:
            raise ValueError(f"{path} was written for optimizer {meta.get('optimizer')!r} and "
                             f"{len(meta.get('clocks', []))} workers, not {self.spec.kind!r} and {self.workers}")
        segs = [SegInfo(*s) for s in meta["segs"]]
        n, names = len(segs), state_names(self.spec)
        if len(arrays) != n * (1 + len(names)):
            raise ValueError(f"{path}: expected {n * (1 + len(names))} arrays, found {len(arrays)}")
        shapes = meta.get("shapes")
        self.seed(segs, arrays[:n], None if shapes is None else {k: tuple(v) for k, v in shapes})
        for k, name in enumerate(names):
            for i in range(n):
                self.opt[i][name][...] = arrays[n + i * len(names) + k]
        self.steps, self.version = list(meta["steps"]), int(meta["version"])
        self.clocks = list(meta["clocks"])
        for w, steps in enumerate(meta["recent"]):
            self.recent[w].extend(steps)
        self.dropped = set(meta["dropped"])
        self.late = set(meta.get("late", []))  # a checkpoint from before late joiners: none
        # a checkpoint from before inits were checked: every worker was admitted then
        self.joined = set(meta.get("joined", range(self.workers)))
        self.staleness = collections.Counter()
        for k, v in meta["staleness"].items():  # a checkpoint from before MAX_GAP: fold the tail
            self.staleness[min(int(k), MAX_GAP)] += v
