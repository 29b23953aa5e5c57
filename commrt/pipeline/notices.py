"""What a pipeline step that fails tells the ranks waiting on it, so none waits out its deadline.

A rank whose step raises posts a notice on every channel it still owes a message this step: in
place of the next message, metadata ``(LOST, rank)`` when a peer died (the PeerLost it met) or
``(FAILED, rank)`` and the error's text when a step raised while its process lives on (a user who
caught the error). The neighbour raises the notice (PeerLost or StageFailed, naming the rank, not
the messenger) and passes it on the same way: the relay the collectives do with their ABORT
header. A channel owed nothing more gets nothing: its reader is not waiting there, and the notice
would be the first message of its next step.
"""
from __future__ import annotations

import logging

import torch

from commrt import distributed as dist
from commrt.runtime.errors import CommError, PeerLost

log = logging.getLogger(__name__)

LOST = 1 << 39  # metadata (LOST, rank) in place of a micro-batch's: "rank is gone, stop"
FAILED = LOST + 1  # (FAILED, rank) and the error's text: "rank's step raised, stop"
NOTE_BYTES = 512  # of that text


class StageFailed(CommError):
    """Another rank's pipeline step raised while its process lives on (its user caught the
    error): names that rank (``rank``), what it ran and its error (``reason``), the action this
    rank was at (``op``) and the neighbour that passed the notice on (``reported_by``; None when
    the failed rank told this one itself)."""

    def __init__(self, rank: int, op: str, reason: str, reported_by: int | None = None):
        self.rank, self.op, self.reason, self.reported_by = rank, op, reason, reported_by
        via = "" if reported_by is None else f" (reported by rank {reported_by})"
        super().__init__(f"pipeline rank {rank} failed: {reason}; seen during {op}{via}")


def is_notice(meta: tuple) -> bool:
    return len(meta) == 2 and meta[0] in (LOST, FAILED)


def error_of(action, src_rank: int, meta: tuple, tensors: list) -> CommError:
    """The error a notice from ``src_rank`` names, met by this rank at ``action``."""
    rank, op = meta[1], f"pipeline {action} on rank {dist.get_rank()}"
    if meta[0] == LOST:
        return PeerLost(rank, op, 0, f"reported by rank {src_rank}", reported_by=src_rank)
    text = bytes(tensors[0].numpy()).decode("utf-8", "replace") if tensors else "(no reason given)"
    return StageFailed(rank, op, text, None if src_rank == rank else src_rank)


def tell(chan, send_plan: dict, exc: Exception, current, sends: list) -> None:
    """Post the notice for ``exc`` on every channel of ``send_plan`` ((rank, tag) -> messages
    the step sends there) that ``chan`` (channels.Channels) has not sent them all on, except to
    the rank it names and the one that told this one; ``current``: the action that raised.
    The handles go to ``sends``. Best effort: a neighbour gone too is only logged."""
    if not send_plan:
        return
    named = exc.rank if isinstance(exc, (PeerLost, StageFailed)) else None
    skip = {named, getattr(exc, "reported_by", None), dist.get_rank()}
    owed = [ch for ch, n in send_plan.items() if ch[0] not in skip and chan.sent(*ch) < n]
    if not owed:
        return
    if named is None:
        meta, reason = (FAILED, dist.get_rank()), f"{current or 'step()'} raised {type(exc).__name__}: {exc}"
    else:
        meta, reason = (LOST if isinstance(exc, PeerLost) else FAILED, named), getattr(exc, "reason", "")
    note = [torch.frombuffer(bytearray(reason.encode()[:NOTE_BYTES]), dtype=torch.uint8)] if meta[0] == FAILED else []
    posted = []
    for dst, tag in owed:  # all posted before any is waited: a neighbour reads only the first it meets
        try:
            posted.append((dst, chan.send(note, dst, tag, meta)))
        except Exception as err:  # that neighbour is gone as well (gloo raises RuntimeError)
            log.warning("could not tell rank %d that the pipeline step failed (%r): %r", dst, exc, err)
    for dst, handle in posted:
        sends.append(handle)
        try:  # its first message lands in a receive posted at the step's start; over gloo, which
            handle.works[0].wait()  # sends only into a posted receive, the rest waits for the reader
        except Exception as err:
            log.warning("could not tell rank %d that the pipeline step failed (%r): %r", dst, exc, err)


def describe(config) -> str:
    """A schedule's ``(micro-batches, stages, batches)`` in words."""
    config = tuple(config) + ("?",) * (3 - len(config))
    return (f"{config[0]} micro-batches over {config[1]} stages"
            + ("" if config[2] == 1 else f" in {config[2]} batches"))
