"""Binding policy: plaintext sockets stay on loopback unless the config explicitly accepts the
risk. (CURVE authentication is issue #4; until it lands, asking for it is an error, never a
silent downgrade.)"""
from __future__ import annotations

import ipaddress
import logging
import socket

from .config import Config
from .errors import ConfigError

log = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def check_bind(cfg: Config, hosts: list[str]) -> None:
    """Refuse to expose unauthenticated sockets beyond this host unless allowed."""
    if cfg.security.mode == "curve":
        raise ConfigError("[security] mode = 'curve' is not available in this build yet; use "
                          "mode = 'none' on loopback, or on a trusted network with allow_insecure = true")
    exposed = sorted({h for h in hosts if not is_loopback(h)})
    if not exposed:
        return
    if not cfg.security.allow_insecure:
        raise ConfigError(
            f"refusing to listen on {exposed} without authentication: anyone who can reach these "
            "addresses could join the job. Bind to loopback, or set [security] allow_insecure = true "
            "(COMMRT_SECURITY_ALLOW_INSECURE=1) on a trusted network")
    log.warning("listening on %s WITHOUT authentication (allow_insecure = true)", exposed)
