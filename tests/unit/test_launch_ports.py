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
