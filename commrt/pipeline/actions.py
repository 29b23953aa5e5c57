"""The vocabulary of pipeline schedules: an action ``(stage, kind, microbatch)`` and its compact
text form (torch.distributed.pipelining's: ``0F1`` is stage 0's forward of micro-batch 1,
``1RECV_B0`` stage 1 receiving micro-batch 0's gradient), shared by the schedules
(schedules.py), their pre-flight check (validate.py) and the runtime.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

F, B, I, W = "F", "B", "I", "W"  # forward, full backward, input-grad backward, weight-grad backward
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
UPDATE = "U"  # PipeDream: the stage's optimizer step after a batch's last backward (mb = the batch)
COMPUTE = (F, B, I, W)
COMMS = (SEND_F, RECV_F, SEND_B, RECV_B)
KINDS = COMPUTE + COMMS + (UPDATE,)
_PARSE = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W|U)(\d+)$")


@dataclass(frozen=True)
class Action:
    stage: int
    kind: str
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"

    @staticmethod
    def parse(text: str) -> "Action":
        m = _PARSE.match(text.strip())
        if not m:
            raise ValueError(f"not an action: {text!r} (expected e.g. '0F1', '2RECV_B3')")
        return Action(int(m.group(1)), m.group(2), int(m.group(3)))


def parse_actions(rows: list[str]) -> list[list[Action]]:
    """``["0F0 0SEND_F0", "1RECV_F0 1F0"]`` -> per-rank action lists (for tests and debugging)."""
    return [[Action.parse(t) for t in row.split()] for row in rows]


def format_grid(actions: list[list[Action]], mark: tuple[int, int] | None = None,
                window: tuple[int, int] | None = None) -> str:
    """One column per rank, one row per step; ``mark=(rank, step)`` is flagged with ``<<``."""
    steps = max((len(a) for a in actions), default=0)
    lo, hi = window if window else (0, steps)
    cells = [[str(a[i]) if i < len(a) else "" for a in actions] for i in range(lo, min(hi, steps))]
    width = max([len(f"rank {len(actions) - 1}")] + [len(c) + 2 for row in cells for c in row])
    lines = ["step " + "".join(f"rank {r}".ljust(width) for r in range(len(actions)))]
    for i, row in enumerate(cells, start=lo):
        text = "".join((c + (" <<" if mark == (r, i) else "")).ljust(width) for r, c in enumerate(row))
        lines.append(f"{i:>4} " + text.rstrip())
    return "\n".join(lines)
