"""Process groups: which global ranks take part, and the backend that serves them."""
from __future__ import annotations

from dataclasses import dataclass

from commrt.backends.base import Backend


@dataclass(frozen=True)
class ProcessGroup:
    ranks: tuple[int, ...]
    """Global ranks of the members; a member's group rank is its index here."""
    rank: int
    """This process's group rank."""
    backend: Backend
    group_id: int

    def size(self) -> int:
        return len(self.ranks)

    def group_rank(self, global_rank: int, what: str = "rank") -> int:
        try:
            return self.ranks.index(global_rank)
        except ValueError:
            raise ValueError(f"{what} {global_rank} is not in this group (ranks {list(self.ranks)})") from None


class _NonMember:
    """Returned by ``new_group`` on processes that are not members (like torch's)."""

    def __repr__(self) -> str:
        return "NON_GROUP_MEMBER"


NON_GROUP_MEMBER = _NonMember()
