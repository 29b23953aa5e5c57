"""Who may talk to us. Two modes:

- ``none``: plaintext, and only on loopback unless ``allow_insecure = true`` says the network is
  trusted (logged loudly).
- ``curve``: ZeroMQ's CURVE on every socket. Each process (``rank<r>``, ``server<i>``) has a key
  pair; ``allow.txt`` lists the job's public keys by name. A ZAP handler, started before any
  socket binds (without one libzmq accepts every key), admits only listed keys and tags each
  connection with the key's name, so a receiver can check that a message claiming to be from
  rank r came over rank r's key.
"""
from __future__ import annotations

import ipaddress
import logging
import os
import socket

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from .config import Config
from .errors import ConfigError

log = logging.getLogger(__name__)
ALLOW_FILE = "allow.txt"
DOMAIN = "commrt"


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def check_bind(cfg: Config, hosts: list[str]) -> None:
    """Refuse to expose unauthenticated sockets beyond this host unless allowed."""
    if cfg.security.mode == "curve":
        return
    exposed = sorted({h for h in hosts if not is_loopback(h)})
    if not exposed:
        return
    if not cfg.security.allow_insecure:
        raise ConfigError(
            f"refusing to listen on {exposed} without authentication: anyone who can reach these "
            "addresses could join the job. Use [security] mode = 'curve' (commrt keygen), bind to "
            "loopback, or set allow_insecure = true (COMMRT_SECURITY_ALLOW_INSECURE=1) on a trusted network")
    log.warning("listening on %s WITHOUT authentication (allow_insecure = true)", exposed)


def keygen(directory: str, names: list[str]) -> None:
    """Write one key pair per name (``<name>.key``, mode 0600) and the public allow-list."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    lines = []
    for name in names:
        public, secret = zmq.curve_keypair()
        path = os.path.join(directory, f"{name}.key")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(f"{public.decode()} {secret.decode()}\n")
        os.chmod(path, 0o600)
        lines.append(f"{name} {public.decode()}")
    with open(os.path.join(directory, ALLOW_FILE), "w") as fh:
        fh.write("\n".join(lines) + "\n")


class Keyring:
    """This process's key pair and the job's allow-list (name -> public key)."""

    def __init__(self, directory: str, me: str):
        if not directory:
            raise ConfigError("[security] mode = 'curve' needs keys_dir (make one with `commrt keygen`; "
                              "`commrt launch` makes one for local jobs)")
        try:
            with open(os.path.join(directory, ALLOW_FILE)) as fh:
                rows = [line.split() for line in fh if line.strip() and not line.startswith("#")]
            with open(os.path.join(directory, f"{me}.key")) as fh:
                public, secret = fh.read().split()
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read the keys of {me} in {directory}: {exc}") from None
        if any(len(r) != 2 or len(r[1]) != 40 for r in rows):
            raise ConfigError(f"{directory}/{ALLOW_FILE}: every line must be '<name> <40-char z85 key>'")
        self.allowed = {name: key.encode() for name, key in rows}
        self.names = {key: name for name, key in self.allowed.items()}
        self.me, self.public, self.secret = me, public.encode(), secret.encode()
        if self.allowed.get(me) != self.public:
            raise ConfigError(f"{me}'s public key is not the one {directory}/{ALLOW_FILE} lists for it")

    def public_of(self, name: str) -> bytes:
        try:
            return self.allowed[name]
        except KeyError:
            raise ConfigError(f"no public key for {name} in the allow-list") from None


class _Authenticator(ThreadAuthenticator):
    """ZAP handler: admit only allow-listed keys; the connection's User-Id is the key's name."""

    def __init__(self, ctx: zmq.Context, ring: Keyring):
        super().__init__(ctx)
        self.ring = ring

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self.ring.names.get(z85.encode(client_public_key), "")

    def callback(self, domain: str, key: bytes) -> bool:  # credentials provider
        allowed = key in self.ring.names
        if not allowed:
            log.warning("refused a connection with an unknown CURVE key %s", key[:8].decode(errors="replace"))
        return allowed


class Guard:
    """Applies the security mode to the sockets of one zmq.Context."""

    def __init__(self, ctx: zmq.Context, cfg: Config, me: str):
        self.ring: Keyring | None = None
        self._auth = None
        if cfg.security.mode != "curve":
            return
        self.ring = Keyring(cfg.security.keys_dir, me)
        self._auth = _Authenticator(ctx, self.ring)
        self._auth.start()
        self._auth.configure_curve_callback(DOMAIN, credentials_provider=self._auth)

    @property
    def active(self) -> bool:
        return self.ring is not None

    def server(self, sock: zmq.Socket) -> None:
        """Before bind: this socket accepts only allow-listed clients."""
        if self.ring:
            sock.setsockopt(zmq.ZAP_DOMAIN, DOMAIN.encode())
            sock.curve_secretkey, sock.curve_publickey = self.ring.secret, self.ring.public
            sock.curve_server = True

    def client(self, sock: zmq.Socket, peer: str) -> None:
        """Before connect: talk only to ``peer`` (its public key authenticates it to us)."""
        if self.ring:
            sock.curve_secretkey, sock.curve_publickey = self.ring.secret, self.ring.public
            sock.curve_serverkey = self.ring.public_of(peer)

    def peer_of(self, frame: zmq.Frame) -> str | None:
        """The authenticated name of whoever sent ``frame`` (None without CURVE)."""
        return frame.get("User-Id") if self.ring else None

    def close(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
