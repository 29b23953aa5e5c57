"""``commrt.launch.free_port``: a port for a server that binds it later, from outside the range
the kernel hands out by itself (a port picked there was taken by another process's socket
before torchrun's store bound it: EADDRINUSE beside a parallel test)."""
import socket

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


def test_the_kernels_choice_when_the_range_below_is_taken(monkeypatch):
    monkeypatch.setattr(launch, "_ephemeral_ports", lambda: (2049, 60999))  # a pool of 1024..2048
    taken = []
    try:
        for port in range(1024, 2049):
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            taken.append(s)
        port = launch.free_port()
        assert port >= 2049, port
    finally:
        for s in taken:
            s.close()
