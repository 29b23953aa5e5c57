"""torch.distributed's side of a gloo/nccl world: its TCPStore (served by rank 0 on a socket
bound where our own store is), the interface gloo uses, and the backend string torch is given.
Split from bootstrap.py, which decides what to start; this module only starts it."""
from __future__ import annotations

import contextlib
import datetime
import fcntl
import ipaddress
import os
import socket
import struct

import torch

from commrt.runtime import rendezvous
from commrt.runtime.config import Config
from commrt.runtime.store import wait_for


def _listening_socket(host: str) -> int:
    """A TCP socket listening on ``host`` (any free port), handed over as a file descriptor:
    torch's TCPStore has no bind-address argument and otherwise listens on every interface,
    so rank 0 gives it a socket bound where our own store is (MASTER_ADDR)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        sock.listen(1024)
    except BaseException:
        sock.close()
        raise
    return sock.detach()  # the store owns the descriptor from here on


def interface_of(ip: str) -> str | None:
    """The name of the network interface whose IPv4 address is ``ip`` (any loopback address:
    the loopback interface), or None."""
    want_loopback = ipaddress.ip_address(ip).is_loopback
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:  # SIOCGIFADDR: the interface's IPv4 address
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
        addr = ipaddress.ip_address(socket.inet_ntoa(raw[20:24]))
        if str(addr) == ip or (want_loopback and addr.is_loopback):
            return name
    return None


@contextlib.contextmanager
def gloo_interface(cfg: Config):
    """Gloo picks its interface from $GLOO_SOCKET_IFNAME, else from the host name, which may be
    loopback (unreachable from other hosts) or a public interface (beyond our loopback default).
    While a gloo group is made, point it at the interface of the address we advertise, unless
    the user chose one; the variable is restored afterwards."""
    name = None if "GLOO_SOCKET_IFNAME" in os.environ else interface_of(
        rendezvous.lookup(cfg.cluster.advertise_host or cfg.cluster.bind_host, "[cluster] advertise_host"))
    if name is None:
        yield
        return
    os.environ["GLOO_SOCKET_IFNAME"] = name
    try:
        yield
    finally:
        os.environ.pop("GLOO_SOCKET_IFNAME", None)


def serve_store(host: str, timeout_s: float):
    """A TCPStore server listening on ``host`` only (any free port; ``.port`` says which).
    ``TCPStore(host, 0, world, True)`` ignores ``host`` and listens, unauthenticated, on every
    interface; a descriptor bound here keeps it where the job's own store is."""
    fd = _listening_socket(host)
    return torch.distributed.TCPStore(host, 0, None, True, timeout=datetime.timedelta(seconds=timeout_s),
                                      wait_for_workers=False, master_listen_fd=fd, use_libuv=True)


def shared_store(rank: int, timeout_s: float, broadcast):
    """torch's TCPStore for a program already in a commrt world: rank 0 serves it at its own
    MASTER_ADDR (where its commrt store is; 127.0.0.1 would send other nodes' ranks to their
    own host), and the port reaches the others through ``broadcast`` (commrt.broadcast)."""
    host = rendezvous.lookup(os.environ.get("MASTER_ADDR", "127.0.0.1"), "MASTER_ADDR")
    tstore = serve_store(host, timeout_s) if rank == 0 else None
    port = torch.tensor([tstore.port if tstore else 0], dtype=torch.int64)
    broadcast(port, 0)
    if tstore is not None:
        return tstore
    return torch.distributed.TCPStore(host, int(port), None, False, timeout=datetime.timedelta(seconds=timeout_s))


def torch_store(store, spec: rendezvous.RendezvousSpec, timeout_s: float, namespace: str):
    """torch's TCPStore, served by rank 0 on a port handed out through our store."""
    if spec.rank == 0:
        tstore = serve_store(spec.host, timeout_s)
        store.set(f"{namespace}torch/port", str(tstore.port).encode())
        return tstore
    port = int(wait_for(store, [f"{namespace}torch/port"], timeout_s, "torch store port")[0])
    return torch.distributed.TCPStore(spec.host, port, None, False, timeout=datetime.timedelta(seconds=timeout_s))


def torch_backend_string(name: str, requested: str) -> str:
    """What torch is asked for. NCCL serves CUDA tensors only: under ``auto`` the job gets
    torch's own pairing (gloo for CPU tensors, NCCL for CUDA ones), so a CPU model on a GPU
    machine works (issue 30 item 8); an explicit ``nccl`` is taken as written."""
    return "cpu:gloo,cuda:nccl" if name == "nccl" and requested == "auto" else name
