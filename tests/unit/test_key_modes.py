"""Who could replace the CURVE keys (transport/key_modes.py): the keys directory's own mode and
owner, the files' owners, and the user-private-group case OpenSSH's StrictModes accepts."""
import grp
import os
import pwd
import stat

import pytest

from commrt.runtime.errors import ConfigError
from commrt.transport import key_modes
from commrt.transport.security import Keyring, keygen

ROOT = os.geteuid() == 0
STRANGER = 54321  # a uid and gid nobody on the test machine has


def _st(mode, uid=1000, gid=1000):
    return os.stat_result((stat.S_IFDIR | mode, 0, 0, 0, uid, gid, 0, 0, 0, 0))


@pytest.mark.parametrize("mode, uid, private, sticky_ok, why", [
    (0o700, 1000, False, False, None),
    (0o755, 0, False, False, None),                   # root's: fine
    (0o700, 1001, False, False, "owned by another user (uid 1001)"),
    (0o770, 1000, True, False, None),                 # group-writable, the group only the user's
    (0o770, 1000, False, False, "writable by others (mode 770)"),
    (0o777, 1000, True, False, "writable by others (mode 777)"),
    (0o1777, 0, False, True, None),                   # a Kubernetes secret volume, for a reader
    (0o1777, 0, False, False, "writable by others (mode 1777)"),  # keygen does not write there
    (0o1777, 1001, False, True, "owned by another user (uid 1001)"),
])
def test_loose_is_strict_modes_with_private_groups(mode, uid, private, sticky_ok, why):
    assert key_modes.loose(_st(mode, uid), 1000, sticky_ok, private=lambda gid, owner: private) == why


def _keys(tmp_path, mode):
    keys = tmp_path / "keys"
    keygen(str(keys), ["rank0", "rank1"])
    keys.chmod(mode)
    return keys


@pytest.mark.parametrize("mode", [0o777, 0o757])
def test_keyring_refuses_a_directory_others_can_write(tmp_path, mode):
    """Only the files' modes were checked: in a directory others can write they could replace
    allow.txt (a new file of theirs, mode 644, passed) and be admitted."""
    keys = _keys(tmp_path, mode)
    with pytest.raises(ConfigError, match=f"keys directory {keys} is writable by others"):
        Keyring(str(keys), "rank0")


def test_keyring_accepts_a_sticky_directory_as_kubernetes_mounts_secrets(tmp_path):
    assert Keyring(str(_keys(tmp_path, 0o1777)), "rank0").me == "rank0"


@pytest.mark.skipif(not ROOT, reason="chown to another user needs root")
def test_keyring_refuses_a_directory_or_file_of_another_user(tmp_path):
    keys = _keys(tmp_path, 0o700)
    os.chown(keys / "allow.txt", STRANGER, -1)
    with pytest.raises(ConfigError, match="allow.txt is owned by another user"):
        Keyring(str(keys), "rank0")
    os.chown(keys / "allow.txt", 0, -1)
    os.chown(keys, STRANGER, -1)
    with pytest.raises(ConfigError, match=f"keys directory {keys} is owned by another user"):
        Keyring(str(keys), "rank0")


@pytest.mark.skipif(not ROOT, reason="chgrp to a group the user is not in needs root")
def test_a_group_writable_directory_of_a_shared_group_is_refused(tmp_path):
    keys = _keys(tmp_path, 0o770)
    os.chown(keys, -1, STRANGER)
    with pytest.raises(ConfigError, match="writable by others"):
        Keyring(str(keys), "rank0")


def _my_group_is_private() -> bool:
    me = pwd.getpwuid(os.geteuid())
    others = [p for p in pwd.getpwall() if p.pw_gid == me.pw_gid and p.pw_uid != me.pw_uid]
    return not others and set(grp.getgrgid(me.pw_gid).gr_mem) <= {me.pw_name}


@pytest.mark.skipif(not _my_group_is_private(), reason="this user's primary group has other members")
def test_keygen_and_keyring_accept_a_directory_of_the_users_private_group(tmp_path):
    """keygen refused any group-writable directory, though under user-private groups (umask 002,
    every user alone in their group) that is every directory the user makes; ssh accepts it."""
    from commrt.cli import main
    keys = tmp_path / "keys"
    keys.mkdir()
    os.chown(keys, -1, pwd.getpwuid(os.geteuid()).pw_gid)
    keys.chmod(0o770)
    assert main(["keygen", str(keys), "-n", "1"]) == 0
    assert Keyring(str(keys), "rank0").me == "rank0"
