"""Who could read or replace the CURVE key files (transport/security.py, ``commrt keygen``).

Whoever can write the keys directory can put their own ``allow.txt`` or ``.key`` in it, whatever
the modes of the files there now; the readers would then admit that person's key, or speak as
them. The rule is OpenSSH's StrictModes (``safe_path`` in misc.c), with the user-private-group
exception of Debian's ``user-group-modes`` patch (``secure_permissions``): a directory or file
is the user's or root's, not writable by others, and group-writable only when that group has
exactly one member, its owner (the group ``useradd`` makes for each user on most distributions).

Readers also accept a sticky directory (mode 1777): Kubernetes mounts secret volumes so
(root-owned), and there only an entry's owner may rename or remove it, so the files, checked to
be the user's or root's, cannot be swapped. ``commrt keygen`` does not write into one: a file
someone else made there first would receive the secret key.
"""
from __future__ import annotations

import grp
import os
import pwd
import stat

from commrt.runtime.errors import ConfigError


def private_group(gid: int, owner: int) -> bool:
    """True when group ``gid`` has exactly one member, ``owner``: nobody else has it as their
    primary group or is listed in it (a group with no members at all is not private)."""
    try:
        listed, name = grp.getgrgid(gid).gr_mem, pwd.getpwuid(owner).pw_name
    except KeyError:  # a gid or uid the user database does not know
        return False
    primary = {p.pw_uid for p in pwd.getpwall() if p.pw_gid == gid}
    return primary <= {owner} and set(listed) <= {name} and bool(primary or listed)


def loose(st: os.stat_result, uid: int, sticky_ok: bool = False, private=private_group) -> str | None:
    """Why someone other than ``uid`` and root could replace the directory or file of stat
    ``st`` (the words after "is"), or None. ``sticky_ok``: a sticky directory is safe (its
    entries are checked one by one). ``private(gid, owner)`` says whether a group is private."""
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid not in (uid, 0):
        return f"owned by another user (uid {st.st_uid})"
    if not mode & (stat.S_IWGRP | stat.S_IWOTH) or (sticky_ok and mode & stat.S_ISVTX):
        return None
    if mode & stat.S_IWOTH or not private(st.st_gid, st.st_uid):
        return f"writable by others (mode {mode:o})"
    return None


def refuse_loose_directory(directory: str) -> None:
    """ConfigError if others could replace the files of the keys directory ``directory``."""
    try:
        st = os.stat(directory)
    except OSError as exc:
        raise ConfigError(f"cannot read the keys directory {directory}: {exc}") from None
    why = loose(st, os.geteuid(), sticky_ok=True)
    if why:
        raise ConfigError(f"the keys directory {directory} is {why}: they could replace its keys; "
                          f"run: chmod go-w {directory} (and keep it yours)")


def refuse_loose_file(path: str, st: os.stat_result, bits: int, what: str) -> None:
    """ConfigError if the file of stat ``st`` is another user's, or its mode has any of
    ``bits``: a key file other users can read lets them in as its owner, and an allow-list
    they can write lets them add their own key. Group read stays allowed for the key
    (Kubernetes mounts secrets 0440 for the pod's group)."""
    if st.st_uid not in (os.geteuid(), 0):
        raise ConfigError(f"{path} is owned by another user (uid {st.st_uid}), who could change it")
    if st.st_mode & bits:
        fix = "chmod 600" if what.startswith("readable") else "chmod go-w"
        raise ConfigError(f"{path} is {what} by other users (mode {stat.S_IMODE(st.st_mode):o}); run: {fix} {path}")
