"""``commrt.launch.free_port``: a port for a server that binds it later, from outside the range
the kernel hands out by itself (a port picked there was taken by another process's socket
before torchrun's store bound it: EADDRINUSE beside a parallel test)."""
import io
import socket
import sys

import pytest
import zmq

from commrt import launch


def test_ports_come_from_below_the_kernels_range_and_are_free():
    low, high = launch._ephemeral_ports()
    for _ in range(50):
        port = launch.free_port()
        assert 1024 <= port < low or port > high, (port, low, high)
        assert not 29400 <= port < 29600, port  # torch's defaults
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free when returned (nothing else picks from there)


def test_avoid_gives_distinct_ports():
    ports: list[int] = []
    for _ in range(40):
        ports.append(launch.free_port(avoid=ports))
    assert len(set(ports)) == len(ports)
    env = launch.server_env(5, 2, {})
    addresses = env["COMMRT_PS_SERVERS"].split(",")
    assert len(set(addresses)) == 5 and env["COMMRT_PS_WORKERS"] == "2"


def test_the_kernels_choice_when_every_port_outside_its_range_is_taken(monkeypatch):
    real_low, real_high = launch._ephemeral_ports()
    monkeypatch.setattr(launch, "_ephemeral_ports", lambda: (1024, 65435))  # outside: 65436..65535
    monkeypatch.setattr(launch, "_given", launch.collections.deque(maxlen=256))
    taken = []
    try:
        for port in range(65436, 65536):
            s = socket.socket()
            taken.append(s)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use already: taken either way
                pass
        port = launch.free_port()
        assert real_low <= port <= real_high, port
    finally:
        for s in taken:
            s.close()


def test_no_port_outside_the_range_is_the_kernels_choice_not_an_error(monkeypatch):
    low, high = launch._ephemeral_ports()
    monkeypatch.setattr(launch, "_ephemeral_ports", lambda: (1024, 65535))  # a common tuning
    assert low <= launch.free_port() <= high


def test_one_process_never_gets_a_port_twice_in_a_row():
    """launch() picks MASTER_PORT, then server_env the servers': they must differ."""
    picks = [launch.free_port() for _ in range(200)]
    assert len(set(picks)) == len(picks)


PICK_THE_MASTER_PORT = """
import os, random, sys
from commrt import launch
port = int(os.environ["MASTER_PORT"])
class Same(random.SystemRandom):
    def choice(self, seq):
        return port  # another process's picker lands on the launch's port (once in ~16,000)
random.SystemRandom = Same
got = launch.free_port()
print("picked", got, "master", port, flush=True)
sys.exit(1 if got == port else 0)
"""


def test_another_process_cannot_pick_the_port_a_launch_handed_to_its_ranks():
    """launch() picked MASTER_PORT with a test bind it closed at once; until rank 0's store bound
    it, another process's free_port could hand out the same port (two parallel launches, one of
    which then failed with EADDRINUSE). The launch now holds the port (reserve_port) until it
    ends: a rank of it picking that very port is told another, and rank 0's store still binds."""
    out = io.StringIO()
    result = launch.launch(1, [sys.executable, "-c", PICK_THE_MASTER_PORT], out=out, timeout_s=60)
    assert result.returncode == 0, out.getvalue()
    assert "picked" in out.getvalue()


def test_a_reserved_port_is_refused_to_pickers_and_taken_by_a_server():
    port, held = launch.reserve_port()
    try:
        with socket.socket() as s, pytest.raises(OSError):
            s.bind(("127.0.0.1", port))  # what free_port's test bind does
        ctx = zmq.Context()
        server = ctx.socket(zmq.ROUTER)
        server.bind(f"tcp://127.0.0.1:{port}")  # what the store does (SO_REUSEADDR)
        server.close(0)
        ctx.term()
    finally:
        held.close()
