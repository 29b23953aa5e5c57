"""The process's default runtime, like torch's default process group: set by
``init_process_group``, read by the layers that default to the world group (the two-level
dispatch, the quantized collectives, ``comm_stats``). They sit below the public API
(``commrt.distributed``), so they read it here instead of reaching up into that module."""
from __future__ import annotations

import contextlib

from commrt.runtime.bootstrap import Runtime
from commrt.runtime.errors import CommError
from commrt.runtime.group import NON_GROUP_MEMBER, ProcessGroup

_current: Runtime | None = None


def current() -> Runtime:
    if _current is None:
        raise CommError("commrt is not initialized; call commrt.init_process_group() first")
    return _current


def get() -> Runtime | None:
    return _current


def install(rt: Runtime | None) -> None:
    global _current
    _current = rt


@contextlib.contextmanager
def installed(rt: Runtime):
    """Make ``rt`` the default runtime for a block (``commrt bench`` holds several side by side)."""
    saved = _current
    install(rt)
    try:
        yield rt
    finally:
        install(saved)


def resolve(group) -> ProcessGroup | None:
    """``group`` as a live group of the default runtime: None means the world, a non-member's
    handle gives None (torch's collectives return None there too)."""
    if group is None:
        return (_current or current()).world  # current() only to raise its error
    if group is NON_GROUP_MEMBER:
        return None
    return live(current(), group)


def live(rt: Runtime, group) -> ProcessGroup:
    """``group`` if it is one of this runtime's groups; a clear error for a destroyed handle
    (its sockets are closed: using it used to surface as a bare ``KeyError`` from the endpoint)."""
    if group is rt.world or any(g is group for g in rt.groups):
        return group
    if not isinstance(group, ProcessGroup):
        raise TypeError(f"group must be a ProcessGroup from new_group() or None, got {type(group).__name__}")
    raise CommError(f"process group {group.group_id} (ranks {list(group.ranks)}) was destroyed by "
                    "destroy_process_group(); create a new one with new_group()")
