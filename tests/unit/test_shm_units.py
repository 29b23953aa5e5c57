"""The shared-memory transport's segment rules and the [comm] intra_node setting (no processes)."""
import os
import stat

import pytest

from commrt.config import load_config
from commrt.errors import ConfigError, ProtocolError
from commrt.transport import shm

SLOT = 4096


@pytest.fixture
def segment():
    name, mm = shm.create(SLOT)
    yield name, mm
    shm.unlink(name)
    mm.close()


def test_segments_are_0600_under_unguessable_names(segment):
    name, _ = segment
    st = os.stat(os.path.join(shm.SHM_DIR, name))
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_size == shm.segment_bytes(SLOT)
    other, mm = shm.create(SLOT)
    shm.unlink(other)
    mm.close()
    assert len(name) == len("commrt-") + 32 and name != other


def test_attach_accepts_only_our_segments(segment):
    name, _ = segment
    shm.attach(name, SLOT).close()
    for bad in ("../etc/passwd", "commrt-xyz", "", None, name + "0"):
        with pytest.raises(ProtocolError):
            shm.attach(bad, SLOT)
    with pytest.raises(ProtocolError, match="bytes"):
        shm.attach(name, 2 * SLOT)  # a peer with another slot size
    os.chmod(os.path.join(shm.SHM_DIR, name), 0o644)
    with pytest.raises(ProtocolError, match="0600"):
        shm.attach(name, SLOT)


def test_attach_refuses_a_file_without_our_header():
    name = "commrt-" + "ab" * 16
    path = os.path.join(shm.SHM_DIR, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, shm.segment_bytes(SLOT))
        with pytest.raises(ProtocolError, match="header"):
            shm.attach(name, SLOT)
    finally:
        os.close(fd)
        shm.unlink(name)
    assert not os.path.exists(path)


def test_intra_node_setting():
    assert load_config(environ={}).comm.intra_node == "auto"
    assert load_config(environ={"COMMRT_COMM_INTRA_NODE": "tcp"}).comm.intra_node == "tcp"
    with pytest.raises(ConfigError, match="intra_node"):
        load_config(environ={"COMMRT_COMM_INTRA_NODE": "nvlink"})
    a, b = load_config(environ={}), load_config(environ={"COMMRT_COMM_INTRA_NODE": "tcp"})
    assert a.digest() != b.digest()  # ranks must agree on it


def test_node_key_is_stable():
    assert shm.node_key() == shm.node_key() and len(shm.node_key()) == 16
