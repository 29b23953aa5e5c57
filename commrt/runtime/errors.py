"""Typed errors. Each says what was expected, what arrived, and who is to blame."""
from __future__ import annotations


class CommError(RuntimeError):
    """Base class of every error commrt raises on purpose."""


class ConfigError(CommError, ValueError):
    """A configuration value is unknown or invalid; the message lists what is valid."""


class RendezvousError(CommError):
    """Ranks could not agree on who is who (missing, duplicate or incompatible ranks)."""


class ProtocolError(CommError):
    """A message on the wire is malformed, truncated, oversized or of an unknown version."""


class PeerLost(CommError):
    """A peer died, went silent or closed its connection while an operation needed it."""

    def __init__(self, rank: int, op: str, seq: int, reason: str, role: str = "peer rank",
                 reported_by: int | None = None):
        """``reported_by``: the rank whose notice told us (None: this rank saw it itself)."""
        self.rank, self.op, self.seq, self.reason, self.role = rank, op, seq, reason, role
        self.reported_by = reported_by
        who = role if rank < 0 else f"{role} {rank}"  # rank -1: a receive from any source
        super().__init__(f"lost {who} during {op} (seq {seq}): {reason}")

    def in_group(self, members: list[int], group: int) -> PeerLost:
        """The same loss named by global ranks, for a group whose rank r is global rank
        ``members[r]``: a subgroup's transport numbers its peers by group rank, which a user
        reading "lost peer rank 1" in an HSDP replica group of global ranks [0, 2] would take for
        the wrong process. The reason's own numbers stay the group's, and it says so."""
        if not 0 <= self.rank < len(members):
            return self  # -1: a receive from any source
        by = self.reported_by
        by = members[by] if by is not None and 0 <= by < len(members) else by
        if members[self.rank] == self.rank and by == self.reported_by:
            return self  # the group numbers these ranks as the world does
        return PeerLost(members[self.rank], self.op, self.seq,
                        f"{self.reason} [rank {self.rank} of group {group}; the ranks in this reason are the group's]",
                        self.role, by)


class OpRefused(CommError):
    """A rank refused a collective on its own input (a read-only output, output and input
    dtypes that differ) before sending anything, and told its peers, so they fail at once
    naming it and the op instead of waiting out the deadline. ``reported_by``: a peer that had
    started the op, gave up on it and said so (the refusing rank hears it at its next op: the
    group is unusable)."""

    def __init__(self, rank: int, op: str, seq: int, reason: str, reported_by: int | None = None):
        self.rank, self.op, self.seq, self.reason, self.reported_by = rank, op, seq, reason, reported_by
        text = f"rank {rank} refused {op} (seq {seq}) before sending anything: {reason}"
        if reported_by is not None:
            text += f"; rank {reported_by} had started it and gave up, so the group is unusable"
        super().__init__(text)

    def in_group(self, members: list[int], group: int) -> OpRefused:
        """The same refusal named by global ranks (as ``PeerLost.in_group``)."""
        g = lambda r: members[r] if r is not None and 0 <= r < len(members) else r  # noqa: E731
        if (g(self.rank), g(self.reported_by)) == (self.rank, self.reported_by):
            return self
        out = OpRefused(g(self.rank), self.op, self.seq, self.reason, g(self.reported_by))
        out.args = (f"{out} [group {group}]",)
        return out


class RequestRejected(CommError):
    """A parameter server refused a request (unknown key, wrong shape or dtype, stale step),
    or the client refused it before sending (``server`` None); the server's state is unchanged."""

    def __init__(self, server: int | None, op: str, reason: str):
        self.server, self.op, self.reason = server, op, reason
        who = f"server {server} rejected {op}" if server is not None else f"{op} refused before sending"
        super().__init__(f"{who}: {reason}")


class CollectiveMismatch(CommError):
    """Ranks called different collectives (or with different dtype/size) at the same point."""

    def __init__(self, op: str, seq: int, mine: dict, theirs: dict, peer: int, rank: int,
                 reported_by: int | None = None):
        self.op, self.seq, self.mine, self.theirs, self.peer = op, seq, mine, theirs, peer
        self.rank, self.reported_by = rank, reported_by  # reported_by: the rank that saw it
        seen = "" if reported_by is None else f" (reported by rank {reported_by})"
        other = f"rank {peer} runs {_fmt(theirs)}"
        if peer == rank:  # a corrupt or foreign header: "rank 0 runs A, rank 0 runs B" says nothing
            other = f"but a header attributed to rank {peer} says {_fmt(theirs)} (corrupt, or not from this job)"
        super().__init__(f"collective mismatch at seq {seq}: rank {rank} runs {_fmt(mine)}, {other}{seen}")

    def in_group(self, members: list[int], group: int) -> CollectiveMismatch:
        """The same mismatch named by global ranks, for a group whose rank r is global rank
        ``members[r]`` (as ``PeerLost.in_group``: "rank 1" of the group [0, 2] is global rank 2)."""
        g = lambda r: members[r] if r is not None and 0 <= r < len(members) else r  # noqa: E731
        if (g(self.rank), g(self.peer), g(self.reported_by)) == (self.rank, self.peer, self.reported_by):
            return self
        out = CollectiveMismatch(self.op, self.seq, self.mine, self.theirs, g(self.peer), g(self.rank),
                                 g(self.reported_by))
        out.args = (f"{out} [ranks {self.rank} and {self.peer} of group {group}]",)
        return out


class GroupClosed(CommError):
    """The group was destroyed while this operation was queued or running; it was cancelled
    (its peers see this rank leave). ``seq`` is None for an operation that never started."""

    def __init__(self, group: int, op: str, seq: int | None, reason: str = "the group was closed"):
        self.group, self.op, self.seq, self.reason = group, op, seq, reason
        started = "not started" if seq is None else f"seq {seq}"
        super().__init__(f"group {group}: {op} ({started}) cancelled: {reason}")


def _fmt(d: dict) -> str:
    return "{" + ", ".join(f"{k}={v}" for k, v in d.items()) + "}"
