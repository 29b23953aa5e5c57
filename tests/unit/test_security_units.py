"""Key files and the keyring, without processes."""
import os
import stat

import pytest

from commrt.runtime import bootstrap
from commrt.runtime.config import load_config
from commrt.runtime.errors import ConfigError
from commrt.runtime.rendezvous import RendezvousSpec
from commrt.transport.security import Keyring, keygen


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


def _secret_cfg(path):
    from commrt.runtime.config import Config, SecurityConfig
    return Config(security=SecurityConfig(mode="secret", secret_file=str(path)))


def test_job_secret_comes_from_the_environment_first(tmp_path):
    from commrt.transport.security import SECRET_ENV, job_secret
    assert job_secret(_secret_cfg(tmp_path / "s"), {SECRET_ENV: "from-the-launcher"}) == b"from-the-launcher"
    assert not (tmp_path / "s").exists()


def test_job_secret_file_is_made_private_once_and_then_reused(tmp_path):
    from commrt.transport.security import job_secret
    path = tmp_path / "dir" / "job_secret"
    first = job_secret(_secret_cfg(path), {})
    assert len(first) >= 32 and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    assert job_secret(_secret_cfg(path), {}) == first


def test_concurrent_ranks_read_one_secret(tmp_path):
    """Ranks started together race to create the file: all must read the same secret."""
    import subprocess
    import sys
    path = tmp_path / "job_secret"
    code = ("import sys; from commrt.runtime.config import Config, SecurityConfig; from commrt.transport.security import job_secret; "
            "print(job_secret(Config(security=SecurityConfig(secret_file=sys.argv[1])), {}).decode())")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True)
             for _ in range(6)]
    outs = {p.communicate(timeout=60)[0].strip() for p in procs}
    assert len(outs) == 1 and len(outs.pop()) >= 32


def test_a_secret_file_others_can_read_is_refused(tmp_path):
    from commrt.transport.security import job_secret
    path = tmp_path / "job_secret"
    path.write_text("x" * 40)
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="readable by others"):
        job_secret(_secret_cfg(path), {})
    path.chmod(0o600)
    path.write_text("short")
    with pytest.raises(ConfigError, match="shorter than 16"):
        job_secret(_secret_cfg(path), {})


def test_a_short_secret_is_refused_from_the_environment_as_from_a_file(tmp_path):
    """Issue 13.17: COMMRT_JOB_SECRET=a was accepted while a file needs 16 characters."""
    from commrt.transport.security import SECRET_ENV, job_secret
    with pytest.raises(ConfigError, match=r"COMMRT_JOB_SECRET is shorter than 16"):
        job_secret(_secret_cfg(tmp_path / "s"), {SECRET_ENV: "a"})
    assert job_secret(_secret_cfg(tmp_path / "s"), {SECRET_ENV: "x" * 16}) == b"x" * 16


@pytest.mark.parametrize("file,mode,refused", [
    ("rank0.key", 0o604, "readable or writable by other users (mode 604); run: chmod 600"),
    ("rank0.key", 0o620, "readable or writable by other users (mode 620)"),
    ("allow.txt", 0o666, "writable by other users (mode 666); run: chmod go-w"),
    ("allow.txt", 0o664, "writable by other users"),
    ("rank0.key", 0o440, None),  # Kubernetes' secret volume (defaultMode 0440): group read only
    ("allow.txt", 0o644, None),  # public keys: anyone may read them
])
def test_key_files_others_can_use_are_refused(tmp_path, file, mode, refused):
    """A key file other users can read lets them in as its owner; an allow-list they can write
    lets them add their own key. Both used to be read whatever their mode."""
    keygen(str(tmp_path), ["rank0", "rank1"])
    os.chmod(tmp_path / file, mode)
    if refused is None:
        assert Keyring(str(tmp_path), "rank0").me == "rank0"
    else:
        with pytest.raises(ConfigError, match=refused.replace("(", r"\(").replace(")", r"\)")):
            Keyring(str(tmp_path), "rank0")


def test_keygen_under_a_loose_umask_writes_files_keyring_accepts(tmp_path):
    old = os.umask(0o002)  # Debian's user-private-group default: files 664
    try:
        keygen(str(tmp_path), ["rank0"])
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "allow.txt").st_mode) == 0o644
    assert Keyring(str(tmp_path), "rank0").me == "rank0"


@pytest.mark.parametrize("mode", ["secret", "none"])
def test_a_rank_refuses_to_dial_a_rendezvous_address_off_loopback_without_encryption(tmp_path, mode):
    """Review revF: the README says MASTER_ADDR off loopback without curve or allow_insecure is
    a ConfigError at init, but only rank 0 (which binds it) checked it. Any other rank dialled it,
    and under 'secret' its PLAIN handshake handed the job secret, in the clear, to whoever answered
    there (a mistyped MASTER_ADDR: someone else's host); it failed only at timeout_s, with a
    RendezvousError. 192.0.2.10 is TEST-NET: nothing answers there."""
    cfg = load_config(overrides={"security": {"mode": mode, "secret_file": str(tmp_path / "s")},
                                 "comm": {"timeout_s": 2}}, environ={})
    with pytest.raises(ConfigError, match=r"connect to \['192.0.2.10'\].*MASTER_ADDR"):
        bootstrap.init_world(cfg, RendezvousSpec("192.0.2.10", 29500, 1, 2), environ={})
