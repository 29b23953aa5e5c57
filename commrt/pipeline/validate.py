"""Pre-flight check of a schedule: simulate every rank's actions with send/receive matching before
any process sends anything (PyTorch's equivalent is private and off by default; its users meet
these bugs as hangs: pytorch#172668, #109401, PiPPy#969).

Model: a send never blocks (the runtime posts it and moves on); a receive blocks until the message
it names is at the head of its channel. A channel is one (source stage, destination stage,
direction) pair, first in first out, as the runtime's tags make it.
"""
from __future__ import annotations

import collections

from commrt.runtime.errors import CommError
from commrt.pipeline.actions import (B, COMPUTE, F, I, KINDS, RECV_B, RECV_F, SEND_B, SEND_F, UPDATE, W, Action,
    format_grid)

GRID_CONTEXT = 4  # steps shown either side of the failing one


class ScheduleError(CommError, ValueError):
    """A schedule would deadlock, lose a message or compute on data it never got; names the rank,
    the step (index in that rank's action list) and the action, with the grid around it."""

    def __init__(self, rank: int, step: int, action: Action | None, reason: str, actions=None):
        self.rank, self.step, self.action, self.reason = rank, step, action, reason
        self.grid = ""
        if actions is not None:
            self.grid = format_grid(actions, (rank, step), (max(0, step - GRID_CONTEXT), step + GRID_CONTEXT + 1))
        super().__init__(f"rank {rank}, step {step} ({action}): {reason}" + (f"\n{self.grid}" if self.grid else ""))


def stage_ranks(actions: list[list[Action]]) -> dict[int, int]:
    """stage -> the rank that computes it; a stage computed on two ranks is an error."""
    owner: dict[int, int] = {}
    for r, row in enumerate(actions):
        for i, a in enumerate(row):
            if a.kind in COMPUTE and owner.setdefault(a.stage, r) != r:
                raise ScheduleError(r, i, a, f"stage {a.stage} also computes on rank {owner[a.stage]}", actions)
    return owner


class _Sim:
    def __init__(self, actions: list[list[Action]], num_microbatches: int | None):
        self.actions = actions
        self.owner = stage_ranks(actions)
        self.num_stages = max(self.owner, default=-1) + 1
        mbs = [a.mb for row in actions for a in row if a.kind in COMPUTE]
        self.num_mbs = num_microbatches if num_microbatches is not None else max(mbs, default=-1) + 1
        self.pos = [0] * len(actions)
        self.done: set[tuple[int, str, int]] = set()  # (stage, kind, mb) computed or received
        self.chan: dict[tuple, collections.deque] = collections.defaultdict(collections.deque)

    def fail(self, r: int, i: int, reason: str):
        raise ScheduleError(r, i, self.actions[r][i], reason, self.actions)

    def step(self, r: int) -> bool:
        """Run rank r's next action if it can; False if it is blocked on a receive."""
        i, a = self.pos[r], self.actions[r][self.pos[r]]
        if a.kind not in KINDS:  # before the checks below, whose messages would blame its stage or mb
            self.fail(r, i, f"unknown action kind {a.kind!r}; valid kinds: {', '.join(KINDS)}")
        if a.kind != UPDATE and self.owner.get(a.stage, r) != r:
            self.fail(r, i, f"stage {a.stage} lives on rank {self.owner[a.stage]}")
        if not 0 <= a.mb < self.num_mbs and a.kind != UPDATE:
            self.fail(r, i, f"micro-batch {a.mb} is out of range 0..{self.num_mbs - 1}")
        if a.kind in (RECV_F, RECV_B):
            if not self._recv(r, i, a):
                return False
        elif a.kind in (SEND_F, SEND_B):
            self._send(r, i, a)
        elif a.kind in COMPUTE:
            self._compute(r, i, a)
        self.pos[r] += 1
        return True

    def _send(self, r: int, i: int, a: Action) -> None:
        fwd = a.kind == SEND_F
        peer = a.stage + 1 if fwd else a.stage - 1
        if not 0 <= peer < self.num_stages:
            self.fail(r, i, f"stage {a.stage} has no {'next' if fwd else 'previous'} stage to send to")
        need = [(a.stage, F, a.mb)] if fwd else [(a.stage, B, a.mb), (a.stage, I, a.mb)]
        if not any(n in self.done for n in need):
            self.fail(r, i, f"sends {'activations' if fwd else 'gradients'} of micro-batch {a.mb} "
                            f"before computing them")
        self.chan[(a.stage, peer, fwd)].append((a.mb, r, i))

    def _recv(self, r: int, i: int, a: Action) -> bool:
        fwd = a.kind == RECV_F
        peer = a.stage - 1 if fwd else a.stage + 1
        if not 0 <= peer < self.num_stages:
            self.fail(r, i, f"stage {a.stage} has no {'previous' if fwd else 'next'} stage to receive from")
        q = self.chan[(peer, a.stage, fwd)]
        if not q:
            return False
        mb, sr, si = q[0]
        if mb != a.mb:
            self.fail(r, i, f"expects micro-batch {a.mb} from stage {peer}, but the next message on that "
                            f"channel is micro-batch {mb} (rank {sr}, step {si}: {self.actions[sr][si]})")
        q.popleft()
        self.done.add((a.stage, a.kind, a.mb))
        return True

    def _compute(self, r: int, i: int, a: Action) -> None:
        s, m, last = a.stage, a.mb, self.num_stages - 1
        if (s, a.kind, m) in self.done or (a.kind == B and {(s, I, m), (s, W, m)} & self.done):
            self.fail(r, i, f"computes {a.kind} of micro-batch {m} twice")
        if a.kind == F and s > 0 and (s, RECV_F, m) not in self.done:
            self.fail(r, i, f"forward of micro-batch {m} on data it never received from stage {s - 1}")
        if a.kind in (B, I, W) and (s, F, m) not in self.done:
            self.fail(r, i, f"backward of micro-batch {m} before its forward")
        if a.kind in (B, I) and s < last and (s, RECV_B, m) not in self.done:
            self.fail(r, i, f"backward of micro-batch {m} on a gradient it never received from stage {s + 1}")
        if a.kind == W and (s, I, m) not in self.done:
            self.fail(r, i, f"weight gradient of micro-batch {m} before its input gradient")
        self.done.add((s, a.kind, m))

    def run(self) -> None:
        progress = True
        while progress:
            progress = False
            for r, row in enumerate(self.actions):
                while self.pos[r] < len(row) and self.step(r):
                    progress = True
        stuck = [r for r, row in enumerate(self.actions) if self.pos[r] < len(row)]
        if stuck:
            waits = ", ".join(f"rank {r} at step {self.pos[r]} ({self.actions[r][self.pos[r]]})" for r in stuck)
            self.fail(stuck[0], self.pos[stuck[0]], f"deadlock: every remaining rank waits on a receive: {waits}")
        for (src, dst, fwd), q in self.chan.items():
            if q:
                mb, sr, si = q[0]
                self.fail(sr, si, f"sends micro-batch {mb} to stage {dst}, which never receives it")
        self._complete()

    def _complete(self) -> None:
        for s in range(self.num_stages):
            r = self.owner[s]
            for m in range(self.num_mbs):
                missing = [k for k in (F, B) if (s, k, m) not in self.done]
                if missing == [B] and {(s, I, m), (s, W, m)} <= self.done:
                    missing = []
                if missing:
                    step = len(self.actions[r]) - 1
                    self.fail(r, step, f"micro-batch {m} is skipped: stage {s} never runs {s}{missing[0]}{m}")


def validate(actions: list[list[Action]], num_microbatches: int | None = None) -> None:
    """Raise ScheduleError if ``actions`` (one list per rank) would deadlock, leave a message
    unreceived, compute on data that never arrived or skip a micro-batch."""
    if not actions:
        raise ScheduleError(0, 0, None, "the schedule has no ranks")
    _Sim(actions, num_microbatches).run()
