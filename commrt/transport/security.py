"""Who may talk to us. Three modes:

- ``secret`` (default): every socket that listens is a ZeroMQ PLAIN server whose ZAP handler
  admits a connection only if it presents the job secret (compared in constant time); each
  connection is tagged with the name the client gave (``rank<r>``, ``server<i>``). The check is
  made once per connection, so the data plane runs at plaintext speed. The secret itself crosses
  the wire in the clear during the handshake: loopback (or a trusted fabric) only, like ``none``.
- ``none``: no authentication at all; loopback only unless ``allow_insecure = true``.
- ``curve``: ZeroMQ's CURVE on every socket. Each process (``rank<r>``, ``server<i>``) has a key
  pair; ``allow.txt`` lists the job's public keys by name. A ZAP handler, started before any
  socket binds (without one libzmq accepts every key), admits only listed keys and tags each
  connection with the key's name, so a receiver can check that a message claiming to be from
  rank r came over rank r's key.
"""
from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import socket
import stat

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from commrt.runtime import addresses
from commrt.runtime.config import Config
from commrt.obs.ratelimit import RateLimited
from commrt.runtime.errors import ConfigError
from commrt.transport import key_modes

log = logging.getLogger(__name__)
_refusals = RateLimited(log)  # a peer retrying with a bad key or secret must not flood the log
ALLOW_FILE = "allow.txt"
DOMAIN = "commrt"
SECRET_ENV = "COMMRT_JOB_SECRET"  # set by `commrt launch` for its processes (one secret per job)
DEFAULT_SECRET_FILE = os.path.join("~", ".config", "commrt", "job_secret")
MIN_SECRET = 16  # characters, from the environment or a file alike


def is_loopback(host: str) -> bool:
    try:
        ip = addresses.literal(host) or socket.gethostbyname(host)
        return ipaddress.ip_address(ip).is_loopback
    except (OSError, ValueError):
        return False


def _resolvable(host: str) -> None:
    if host in ("0.0.0.0", "*", "", "::"):
        return
    try:
        socket.getaddrinfo(addresses.bare(host), None)
    except OSError as exc:
        raise ConfigError(f"host {host!r} (bind_host or the rendezvous address) cannot be resolved: "
                          f"{exc}") from None


def check_bind(cfg: Config, hosts: list[str], dialled: list[str] = ()) -> None:
    """Refuse to expose unencrypted sockets beyond this host unless allowed: off the host, a
    PLAIN secret could be sniffed, and no authentication at all lets anyone in. ``dialled``:
    the rendezvous address a rank connects to without binding it, refused alike (the PLAIN
    handshake would hand the job secret, in the clear, to whoever answers there). A host that
    does not resolve is a name-lookup error, not a security one."""
    for host in (*hosts, *dialled):
        _resolvable(host)
    if cfg.security.mode == "curve":
        return
    exposed = sorted({h for h in hosts if not is_loopback(h)})
    remote = sorted({h for h in dialled if not is_loopback(h)} - set(exposed))
    if not exposed and not remote:
        return
    if not cfg.security.allow_insecure:
        what = f"listen on {exposed}" if exposed else f"connect to {remote} (MASTER_ADDR, the rendezvous store)"
        raise ConfigError(
            f"refusing to {what} without encryption (security mode "
            f"'{cfg.security.mode}'): traffic that leaves the host could be read or joined. Use "
            "[security] mode = 'curve' (commrt keygen), bind to loopback, or set allow_insecure = "
            "true (COMMRT_SECURITY_ALLOW_INSECURE=1) on a trusted network")
    what = "with the job secret in the clear" if cfg.security.mode == "secret" else "WITHOUT authentication"
    if exposed:
        log.warning("listening on %s %s (allow_insecure = true)", exposed, what)
    if remote:
        log.warning("connecting to %s %s (allow_insecure = true)", remote, what)


def new_secret() -> str:
    """A fresh job secret (256 random bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def _create_secret_file(path: str) -> None:
    """Write a new secret to ``path`` unless another process got there first: the file appears
    whole (written under a private name, then linked), so concurrent ranks read one secret."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(new_secret() + "\n")
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another process made it first: use theirs
    finally:
        os.unlink(tmp)


def job_secret(cfg: Config, environ=os.environ) -> bytes:
    """The job secret: $COMMRT_JOB_SECRET, else the secret file (made, mode 0600, if missing).
    A secret file that other users can read is refused: it would let them in."""
    if environ.get(SECRET_ENV):
        value = environ[SECRET_ENV]
        if len(value) < MIN_SECRET:
            raise ConfigError(f"${SECRET_ENV} is shorter than {MIN_SECRET} characters (use `commrt launch`, "
                              "which sets a fresh one, or a long random value)")
        return value.encode()
    path = os.path.expanduser(cfg.security.secret_file or DEFAULT_SECRET_FILE)
    try:
        if not os.path.exists(path):
            _create_secret_file(path)
        st = os.stat(path)
        with open(path) as fh:
            value = fh.read().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read or create the job secret file {path}: {exc}") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"the job secret file {path} is readable by others (mode "
                          f"{stat.S_IMODE(st.st_mode):o}); run: chmod 600 {path}")
    if len(value) < MIN_SECRET:
        raise ConfigError(f"the job secret in {path} is shorter than {MIN_SECRET} characters")
    return value.encode()


def derive(secret: bytes, purpose: str) -> str:
    """A value (64 hex digits) of the job secret for ``purpose``, fit to show where others can
    read it (an abstract socket name in /proc/net/unix, torch's unauthenticated store): each
    guess at the secret costs 2**20 PBKDF2 rounds, not one hash, and values for different
    purposes reveal nothing of each other."""
    return hmac.new(_stretched(secret), purpose.encode(), hashlib.sha256).hexdigest()


@functools.lru_cache(maxsize=4)  # ~0.2 s once per process and secret, not once per use
def _stretched(secret: bytes) -> bytes:
    return hashlib.pbkdf2_hmac("sha256", secret, b"commrt/job-secret/v1", 1 << 20)


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
    allow = os.path.join(directory, ALLOW_FILE)
    with os.fdopen(os.open(allow, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    os.chmod(allow, 0o644)  # whatever the umask: Keyring refuses an allow-list others can write


class Keyring:
    """This process's key pair and the job's allow-list (name -> public key)."""

    def __init__(self, directory: str, me: str):
        if not directory:
            raise ConfigError("[security] mode = 'curve' needs keys_dir (make one with `commrt keygen`; "
                              "`commrt launch` makes one for local jobs)")
        allow, mine = os.path.join(directory, ALLOW_FILE), os.path.join(directory, f"{me}.key")
        key_modes.refuse_loose_directory(directory)
        try:
            with open(allow) as fh:
                key_modes.refuse_loose_file(allow, os.fstat(fh.fileno()), stat.S_IWGRP | stat.S_IWOTH, "writable")
                rows = [line.split() for line in fh if line.strip() and not line.startswith("#")]
            with open(mine) as fh:
                key_modes.refuse_loose_file(mine, os.fstat(fh.fileno()), stat.S_IWGRP | stat.S_IRWXO,
                                            "readable or writable")
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
            _refusals.warning("unknown CURVE key", "refused a connection with an unknown CURVE key %s",
                              key[:8].decode(errors="replace"))
        return allowed


class _SecretAuthenticator(ThreadAuthenticator):
    """ZAP handler for PLAIN: admit a connection that presents the job secret; its User-Id is
    the name the client gave. Never logs the password (pyzmq's own PLAIN path does, at debug)."""

    def __init__(self, ctx: zmq.Context, secret: bytes):
        super().__init__(ctx)
        self._secret = secret

    def _authenticate_plain(self, domain: str, username: str, password: str) -> tuple[bool, bytes]:
        if domain == DOMAIN and hmac.compare_digest(password.encode(), self._secret):
            return True, b"OK"
        _refusals.warning("wrong job secret", "refused a connection claiming to be %r: wrong job secret", username[:32])
        return False, b"wrong job secret"


class Guard:
    """Applies the security mode to the sockets of one zmq.Context."""

    def __init__(self, ctx: zmq.Context, cfg: Config, me: str):
        self.mode, self.me = cfg.security.mode, me
        self.ring: Keyring | None = None
        self._secret = b""
        self._auth = None
        if self.mode == "curve":
            self.ring = Keyring(cfg.security.keys_dir, me)
            self._auth = _Authenticator(ctx, self.ring)
            self._auth.start()
            self._auth.configure_curve_callback(DOMAIN, credentials_provider=self._auth)
        elif self.mode == "secret":
            self._secret = job_secret(cfg)
            self._auth = _SecretAuthenticator(ctx, self._secret)
            self._auth.start()  # before any bind: without a ZAP handler libzmq admits anyone

    @property
    def secret(self) -> bytes:
        """The job secret in 'secret' mode, else b"": the shared-memory handoff (handoff.py)
        proves holding it with an HMAC, never sending it."""
        return self._secret

    @property
    def active(self) -> bool:
        return self._auth is not None

    def server(self, sock: zmq.Socket) -> None:
        """Before bind: this socket accepts only clients that authenticate."""
        if self.ring:
            sock.setsockopt(zmq.ZAP_DOMAIN, DOMAIN.encode())
            sock.curve_secretkey, sock.curve_publickey = self.ring.secret, self.ring.public
            sock.curve_server = True
        elif self._secret:
            sock.setsockopt(zmq.ZAP_DOMAIN, DOMAIN.encode())
            sock.plain_server = True

    def client(self, sock: zmq.Socket, peer: str) -> None:
        """Before connect: authenticate to ``peer`` (under curve its key also authenticates it)."""
        if self.ring:
            sock.curve_secretkey, sock.curve_publickey = self.ring.secret, self.ring.public
            sock.curve_serverkey = self.ring.public_of(peer)
        elif self._secret:
            sock.plain_username, sock.plain_password = self.me.encode(), self._secret

    def peer_of(self, frame: zmq.Frame) -> str | None:
        """The authenticated name of whoever sent ``frame`` (None without authentication).
        Under curve it is bound to the sender's key; under secret it is the name the sender
        gave, which only holders of the job secret could give."""
        return frame.get("User-Id") if self.active else None

    def close(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
