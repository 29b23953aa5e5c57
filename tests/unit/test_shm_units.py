"""The shared-memory transport's segment rules and the [comm] intra_node setting (no processes)."""
import fcntl
import os
import types

import pytest

from commrt.runtime.config import load_config
from commrt.backends.zmq_backend import ZmqBackend
from commrt.runtime.errors import ConfigError, PeerLost, ProtocolError
from commrt.transport import segments, shm, shm_p2p

SLOT = 4096


@pytest.fixture
def segment():
    fd, mm = shm.create(SLOT)
    yield fd, mm
    os.close(fd)
    mm.close()


def test_segments_exist_nowhere_in_the_file_system_and_are_sealed(segment):
    """Issue 30.1-3: a memory file, not a /dev/shm name; no holder can resize it."""
    fd, _ = segment
    assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:commrt")
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"commrt-{os.getpid()}-")]
    assert os.fstat(fd).st_size == shm.segment_bytes(SLOT)
    with pytest.raises(PermissionError):
        os.ftruncate(fd, 1)  # would turn the peers' next access into SIGBUS


def test_attach_accepts_only_our_segments(segment, tmp_path):
    fd, _ = segment
    shm.attach(fd, SLOT).close()
    with pytest.raises(ProtocolError, match="bytes"):
        shm.attach(fd, 2 * SLOT)  # a peer with another slot size
    with open(tmp_path / "f", "wb+") as f:  # a plain file of the right size: not sealed
        f.truncate(shm.segment_bytes(SLOT))
        with pytest.raises(ProtocolError, match="sealed"):
            shm.attach(f.fileno(), SLOT)


def test_attach_refuses_a_memory_file_without_our_header():
    fd = os.memfd_create("x", os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, shm.segment_bytes(SLOT))
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, segments.SEALS)
        with pytest.raises(ProtocolError, match="header"):
            shm.attach(fd, SLOT)
    finally:
        os.close(fd)


def test_intra_node_setting():
    assert load_config(environ={}).comm.intra_node == "auto"
    assert load_config(environ={"COMMRT_COMM_INTRA_NODE": "tcp"}).comm.intra_node == "tcp"
    with pytest.raises(ConfigError, match="intra_node"):
        load_config(environ={"COMMRT_COMM_INTRA_NODE": "nvlink"})
    a, b = load_config(environ={}), load_config(environ={"COMMRT_COMM_INTRA_NODE": "tcp"})
    assert a.digest() != b.digest()  # ranks must agree on it


def test_node_key_is_stable():
    assert shm.node_key() == shm.node_key() and len(shm.node_key()) == 16


def test_p2p_ring_wraps_fills_and_frees_in_arrival_order():
    """shm_p2p's ring: payloads never wrap (a piece that does not fit before the end starts at
    the next lap), a full ring says None (the piece goes inline), space comes back only as the
    oldest held regions are released (out-of-order releases wait for the earlier ones), and a
    descriptor outside the ring is a ProtocolError."""
    cap = shm_p2p.RING_BYTES
    fd, mm = shm_p2p.make_ring()
    out = shm_p2p.OutRing(fd, mm)
    try:
        inn = shm_p2p.InRing(shm.attach(fd, shm_p2p.RING_SLOT))
        out.reserve_memory()
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
        out.close()


def test_p2p_a_piece_larger_than_the_ring_goes_inline_at_once():
    """Issue 30.4: "can never fit" is not "no room yet". A piece larger than the ring was
    reported FULL, so every such piece waited FULL_WAIT_S (50 ms) before going inline (a 64 MiB
    send in 16 MiB pieces took 219-313 ms against 40-48 ms in 4 MiB pieces)."""
    fd, mm = shm_p2p.make_ring()
    rings = shm_p2p.Rings({1: (shm_p2p.OutRing(fd, mm), shm_p2p.InRing(shm.attach(fd, shm_p2p.RING_SLOT)))})
    try:
        assert rings.place(1, bytearray(shm_p2p.RING_BYTES + 8)) is None  # inline, no wait
        fits = rings.place(1, bytearray(shm_p2p.RING_BYTES))  # the largest that fits
        assert fits not in (None, shm_p2p.FULL) and fits[:2] == (0, shm_p2p.RING_BYTES)
        rings.write(1, fits[0], bytearray(shm_p2p.RING_BYTES))
        assert rings.place(1, bytearray(shm_p2p.MIN_BYTES)) is shm_p2p.FULL  # no room *yet*
    finally:
        rings.close()


def test_a_failed_peer_check_at_setup_closes_the_point_to_point_rings():
    """_verify_peers (the barrier before data goes through shared memory) failing, as for a rank
    without the job's secret: the rings made for each peer, not yet handed to the p2p engine,
    are closed with the channel. Each leaked its memfd (and mapping) before."""
    def fds():
        return len(os.listdir("/proc/self/fd"))

    def refused():
        raise PeerLost(1, "barrier", 1, "refused")

    before = fds()
    fd, mm = shm_p2p.make_ring()
    inn = shm_p2p.InRing(mm)  # a peer's ring as this rank maps it: ours stands in for it
    closed = []
    channel = types.SimpleNamespace(rings={1: (shm_p2p.OutRing(*shm_p2p.make_ring()), inn)},
                                    close=lambda: closed.append(1))
    backend = types.SimpleNamespace(_shm=channel, barrier=refused)
    with pytest.raises(PeerLost):
        ZmqBackend._verify_peers(backend)
    os.close(fd)
    assert closed and backend._shm is None
    assert fds() == before, "a ring's descriptor is still open"
