"""Key files and the keyring, without processes."""
import os
import stat

import pytest

from commrt.errors import ConfigError
from commrt.security import Keyring, keygen


def test_keygen_writes_private_keys_0600_and_an_allow_list(tmp_path):
    keygen(str(tmp_path), ["rank0", "rank1", "server0"])
    for name in ("rank0", "rank1", "server0"):
        assert stat.S_IMODE(os.stat(tmp_path / f"{name}.key").st_mode) == 0o600
    ring = Keyring(str(tmp_path), "rank1")
    assert set(ring.allowed) == {"rank0", "rank1", "server0"} and ring.names[ring.public] == "rank1"
    assert len(ring.public) == len(ring.secret) == 40


def test_keyring_refuses_a_key_that_is_not_on_the_list(tmp_path):
    keygen(str(tmp_path), ["rank0"])
    (tmp_path / "rank0.key").write_text((tmp_path / "rank0.key").read_text().replace(
        (tmp_path / "rank0.key").read_text()[:40], "x" * 40))
    with pytest.raises(ConfigError, match="not the one"):
        Keyring(str(tmp_path), "rank0")
    with pytest.raises(ConfigError, match="needs keys_dir"):
        Keyring("", "rank0")
    with pytest.raises(ConfigError, match="cannot read"):
        Keyring(str(tmp_path), "rank7")
