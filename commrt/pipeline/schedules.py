"""Pipeline schedules as data: pure functions ``(num_stages, num_microbatches) -> per-rank action
lists``, with no processes and no tensors, so every schedule can be checked exhaustively
(validate.py) before a single message is sent.

An action (actions.py) is ``(stage, kind, microbatch)``, printed in the compact form torch.distributed.pipelining
uses: ``0F1`` is stage 0's forward of micro-batch 1, ``1RECV_B0`` stage 1 receiving micro-batch 0's
gradient. Sends and receives are explicit actions: a receive sits right before the computation that
needs it and a send right after the one that produced the data (sends never block in the runtime).
"""
from __future__ import annotations

from commrt.pipeline.actions import (B, COMMS, COMPUTE, F, I, KINDS, RECV_B, RECV_F, SEND_B, SEND_F, UPDATE,
                                     W, Action, format_grid, parse_actions)
from commrt.pipeline.validate import ScheduleError, validate
from commrt.runtime.errors import ConfigError

__all__ = ["B", "COMMS", "COMPUTE", "F", "I", "KINDS", "RECV_B", "RECV_F", "SEND_B", "SEND_F", "UPDATE", "W",
           "Action", "format_grid", "parse_actions", "gpipe_actions", "one_f_one_b_actions",
           "interleaved_actions", "pipedream_actions", "with_comms"]


def _check(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1 or num_microbatches < 1:
        raise ConfigError(f"need num_stages >= 1 and num_microbatches >= 1, got {num_stages}, {num_microbatches}")


def with_comms(compute: list[list[Action]], num_stages: int) -> list[list[Action]]:
    """Put a receive before every computation that needs a neighbour's data and a send after every
    one that produces data for a neighbour. Stage s's forward input comes from stage s-1; its
    backward needs stage s+1's gradient."""
    out = []
    for row in compute:
        acts = []
        for a in row:
            if a.kind == F and a.stage > 0:
                acts.append(Action(a.stage, RECV_F, a.mb))
            if a.kind in (B, I) and a.stage < num_stages - 1:
                acts.append(Action(a.stage, RECV_B, a.mb))
            acts.append(a)
            if a.kind == F and a.stage < num_stages - 1:
                acts.append(Action(a.stage, SEND_F, a.mb))
            if a.kind in (B, I) and a.stage > 0:
                acts.append(Action(a.stage, SEND_B, a.mb))
        out.append(acts)
    return out


def gpipe_actions(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """GPipe (Huang et al. 2019): every forward, then every backward; all micro-batches in flight."""
    _check(num_stages, num_microbatches)
    mbs = range(num_microbatches)
    return with_comms([[Action(s, F, m) for m in mbs] + [Action(s, B, m) for m in mbs]
                       for s in range(num_stages)], num_stages)


def _one_f_one_b(stage: int, num_stages: int, mbs: list[int], rank_stage: int | None = None) -> list[Action]:
    """1F1B order of one stage (PipeDream, Narayanan et al. 2019): ``num_stages - 1 - stage`` warm-up
    forwards, then alternate one forward and one backward, then drain the backwards."""
    warm = min(num_stages - 1 - (stage if rank_stage is None else rank_stage), len(mbs))
    acts = [Action(stage, F, m) for m in mbs[:warm]]
    for i, m in enumerate(mbs[warm:]):
        acts += [Action(stage, F, m), Action(stage, B, mbs[i])]
    acts += [Action(stage, B, m) for m in mbs[len(mbs) - warm:]] if warm else []
    return acts


def one_f_one_b_actions(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """1F1B: at most ``num_stages - stage`` micro-batches in flight on a stage."""
    _check(num_stages, num_microbatches)
    mbs = list(range(num_microbatches))
    return with_comms([_one_f_one_b(s, num_stages, mbs) for s in range(num_stages)], num_stages)


def _interleaved_order(rank: int, ranks: int, chunks: int, num_microbatches: int, backward: bool):
    """Megatron-LM's interleaved order (Narayanan et al. 2021): micro-batches in rounds of ``ranks``;
    within a round, every micro-batch through chunk 0, then chunk 1, ... (reversed for backward).
    A last round of fewer micro-batches is allowed, so any count works."""
    order = []
    for start in range(0, num_microbatches, ranks):
        group = range(start, min(start + ranks, num_microbatches))
        for c in (reversed(range(chunks)) if backward else range(chunks)):
            order += [Action(c * ranks + rank, B if backward else F, m) for m in group]
    return order


def interleaved_actions(num_ranks: int, num_microbatches: int, stages_per_rank: int = 2) -> list[list[Action]]:
    """Interleaved 1F1B: rank r holds stages r, r + P, r + 2P, ... (P = num_ranks), which cuts the
    bubble by ``stages_per_rank``. Warm-up is Megatron's ``2(P - r - 1) + (v - 1)P`` forwards; with a
    last round of fewer than P micro-batches that can deadlock (the pre-flight check finds it), so
    warm-up grows one forward at a time until the schedule passes. All forwards first always passes."""
    _check(num_ranks, num_microbatches)
    if stages_per_rank < 1:
        raise ConfigError(f"stages_per_rank must be >= 1, got {stages_per_rank}")
    total = num_microbatches * stages_per_rank
    for extra in range(total + 1):
        rows = with_comms([_interleaved_rank(r, num_ranks, num_microbatches, stages_per_rank, extra)
                           for r in range(num_ranks)], num_ranks * stages_per_rank)
        try:
            validate(rows, num_microbatches)
            return rows
        except ScheduleError:
            continue
    raise AssertionError("all-forwards-first interleaving cannot deadlock")


def _interleaved_rank(r: int, ranks: int, num_microbatches: int, chunks: int, extra: int) -> list[Action]:
    fwd = _interleaved_order(r, ranks, chunks, num_microbatches, False)
    bwd = _interleaved_order(r, ranks, chunks, num_microbatches, True)
    total = len(fwd)
    warm = min(2 * (ranks - r - 1) + (chunks - 1) * ranks + extra, total)
    acts = fwd[:warm]
    for i, a in enumerate(fwd[warm:]):
        acts += [a, bwd[i]]
    return acts + bwd[total - warm:]


def pipedream_actions(num_stages: int, num_microbatches: int, num_batches: int = 1) -> list[list[Action]]:
    """PipeDream (asynchronous 1F1B, no flush between batches): one 1F1B run over the
    ``num_batches * num_microbatches`` micro-batches of several batches, with the stage's update
    ``U<b>`` right after batch b's last backward. Forwards keep flowing across the update; the
    runtime keeps the weights each forward used (weight stashing) for its backward."""
    _check(num_stages, num_microbatches)
    total = num_microbatches * num_batches
    rows = []
    for s, row in enumerate(with_comms([_one_f_one_b(s, num_stages, list(range(total)))
                                        for s in range(num_stages)], num_stages)):
        acts = []
        for a in row:
            acts.append(a)
            if a.kind == B and (a.mb + 1) % num_microbatches == 0:
                acts.append(Action(s, UPDATE, a.mb // num_microbatches))
        rows.append(acts)
    return rows
