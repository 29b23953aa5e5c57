"""A failed init leaves nothing behind: the world's zmq backend (and the NCCL fallback's) holds a
shared-memory segment of ~8 MiB (a memfd) that the error path must close, or every retry of a
failing rendezvous leaks one more."""
import os

import pytest

import commrt
from commrt.launch import free_port
from commrt.runtime import bootstrap, rendezvous
from commrt.runtime.config import load_config
from commrt.runtime.errors import RendezvousError
from commrt.runtime.store import StoreClient, StoreServer
from commrt.transport.transport import Transport


def _memfds() -> int:
    """This process's open commrt shared-memory segments."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:commrt")
        except OSError:  # the listing's own descriptor, closed meanwhile
            pass
    return count


def test_a_failed_zmq_rendezvous_closes_the_world_backend():
    before = _memfds()
    with pytest.raises(RendezvousError, match="never joined"):
        commrt.init_process_group(backend="zmq", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                  world_size=2, timeout=1.0)  # rank 1 never comes
    assert _memfds() == before
    assert not commrt.is_initialized()


def test_a_failed_nccl_fallback_closes_its_zmq_backend():
    """``auto`` falls back to zmq when NCCL cannot run; a fallback whose rendezvous then fails
    is never returned to init_world, so _refuse_or_fall_back must close it itself."""
    cfg = load_config(overrides={"security": {"mode": "none"}, "comm": {"backend": "auto"}}, environ={})
    spec = rendezvous.RendezvousSpec("127.0.0.1", free_port(), 0, 2)
    transport = Transport(cfg, "rank0")
    server = StoreServer(transport, spec.host, spec.port)
    store = StoreClient(transport, spec.host, spec.port, 5)
    before = _memfds()
    try:
        with pytest.raises(RendezvousError, match="never joined"):
            bootstrap._refuse_or_fall_back(cfg, spec, "no GPU", store, 1.0, "", transport)
        assert _memfds() == before
    finally:
        store.close()
        server.close()
        transport.close()
