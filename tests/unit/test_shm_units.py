"""The shared-memory transport's segment rules and the [comm] intra_node setting (no processes)."""
import os
import stat

import pytest

from commrt.runtime.config import load_config
from commrt.runtime.errors import ConfigError, ProtocolError
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
    assert name.startswith(f"commrt-{os.getpid()}-") and len(name.rsplit("-", 1)[1]) == 32 and name != other


def test_attach_accepts_only_our_segments(segment):
    name, _ = segment
    shm.attach(name, SLOT).close()
    for bad in ("../etc/passwd", "commrt-1-xyz", "", None, name + "0"):
        with pytest.raises(ProtocolError):
            shm.attach(bad, SLOT)
    with pytest.raises(ProtocolError, match="bytes"):
        shm.attach(name, 2 * SLOT)  # a peer with another slot size
    os.chmod(os.path.join(shm.SHM_DIR, name), 0o644)
    with pytest.raises(ProtocolError, match="0600"):
        shm.attach(name, SLOT)


def test_attach_refuses_a_file_without_our_header():
    name = f"commrt-{os.getpid()}-" + "ab" * 16
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


def test_a_dead_creators_segment_is_swept():
    """A rank SIGKILLed before its group learnt the name: the next segment made on the host
    removes it (pid 2**22 + 1 is above Linux's pid_max: never alive)."""
    name = f"commrt-{(1 << 22) + 1}-" + "cd" * 16
    path = os.path.join(shm.SHM_DIR, name)
    os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
    made, mm = shm.create(SLOT)
    try:
        assert not os.path.exists(path)
    finally:
        shm.unlink(made)
        mm.close()


def test_p2p_ring_wraps_fills_and_frees_in_arrival_order():
    """shm_p2p's ring: payloads never wrap (a piece that does not fit before the end starts at
    the next lap), a full ring says None (the piece goes inline), space comes back only as the
    oldest held regions are released (out-of-order releases wait for the earlier ones), and a
    descriptor outside the ring is a ProtocolError."""
    from commrt.runtime.errors import ProtocolError
    from commrt.transport import shm_p2p
    cap = shm_p2p.RING_BYTES
    out = shm_p2p.OutRing()
    try:
        inn = shm_p2p.InRing(out.name)  # maps, marks mapped, unlinks the name
        assert not os.path.exists(os.path.join("/dev/shm", out.name))
        third = bytes(range(256)) * (cap // 3 // 256)
        regions = []
        for _ in range(3):
            pos = out.reserve(len(third))
            out.write(pos, third)
            regions.append(inn.region(pos, len(third)))
        assert bytes(regions[1].buffer) == third
        assert out.reserve(len(third)) is None  # full: inline
        regions[1].release()
        assert out.reserve(len(third)) is None  # the oldest is still held
        regions[0].release()
        pos = out.reserve(len(third))
        assert pos == cap and pos % cap == 0  # the rest of the lap is too short: the next lap
        with pytest.raises(ProtocolError, match="outside ring"):
            inn.region(pos, cap + 8)
        name, length = shm_p2p.parse(shm_p2p.descriptor(pos, 40, out.name))[2], shm_p2p.parse(
            shm_p2p.descriptor(pos, 40, out.name))[1]
        assert (name, length) == (out.name, 40)
        with pytest.raises(ProtocolError):
            shm_p2p.parse(b"\x01" * 12)
        regions[2].release()
        inn.close()
    finally:
        out.close(0)


def test_p2p_a_piece_larger_than_the_ring_goes_inline_at_once():
    """Issue 30.4: "can never fit" is not "no room yet". A piece larger than the ring was
    reported FULL, so every such piece waited FULL_WAIT_S (50 ms) before going inline (a 64 MiB
    send in 16 MiB pieces took 219-313 ms against 40-48 ms in 4 MiB pieces)."""
    from commrt.transport import shm_p2p
    rings = shm_p2p.Rings({1})
    try:
        assert rings.place(1, bytearray(shm_p2p.RING_BYTES + 8)) is None  # inline, no wait
        fits = rings.place(1, bytearray(shm_p2p.RING_BYTES))  # the largest that fits
        assert fits not in (None, shm_p2p.FULL) and fits[:2] == (0, shm_p2p.RING_BYTES)
        rings.write(1, fits[0], bytearray(shm_p2p.RING_BYTES))
        assert rings.place(1, bytearray(shm_p2p.MIN_BYTES)) is shm_p2p.FULL  # no room *yet*
    finally:
        rings.close(wait_s=0)
