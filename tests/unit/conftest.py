"""Fixtures shared by the unit tests."""
from __future__ import annotations

import pytest

from commrt.launch import free_port
from commrt.runtime.config import load_config
from commrt.runtime.store import StoreClient, StoreServer
from commrt.transport.transport import Transport


@pytest.fixture()
def store():
    """A real store on loopback (mode none); calling the fixture's value opens one more client."""
    t = Transport(load_config(overrides={"security": {"mode": "none"}}, environ={}), "rank0")
    port = free_port()
    server = StoreServer(t, "127.0.0.1", port)
    clients = []
    yield lambda: clients.append(StoreClient(t, "127.0.0.1", port, 30)) or clients[-1]
    for c in clients:
        c.close()
    server.close()
    t.close()


@pytest.fixture()
def world1():
    """A commrt world of one rank (the engine tests at world size 1)."""
    import commrt
    commrt.init_process_group(init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    commrt.destroy_process_group()
