"""Host and port in the forms commrt reads and writes: IPv4 and IPv6 alike.

An IPv6 literal in an address goes in brackets (``tcp://[::1]:29500``, as ZeroMQ and URLs
write it); a bare host (a setting such as ``bind_host = "::1"``) goes without. Host names
are left to the resolver of whoever uses them.
"""
from __future__ import annotations

import ipaddress
import socket


def bare(host: str) -> str:
    """``host`` without the brackets of an IPv6 literal."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def is_ipv6(host: str) -> bool:
    """Whether ``host`` (bracketed or not) is an IPv6 literal; host names are not."""
    return ":" in bare(host)


def family(host: str) -> socket.AddressFamily:
    """The socket family that reaches ``host`` (a name: IPv4, as ``rendezvous.lookup`` resolves)."""
    return socket.AF_INET6 if is_ipv6(host) else socket.AF_INET


def url_host(host: str) -> str:
    """``host`` as it goes before ``:port``: an IPv6 literal in brackets."""
    host = bare(host)
    return f"[{host}]" if ":" in host else host


def join(host: str, port: int | str) -> str:
    """``host:port``, the host in brackets when it is an IPv6 literal."""
    return f"{url_host(host)}:{port}"


def tcp_url(host: str, port: int | str) -> str:
    """ZeroMQ's ``tcp://host:port``."""
    return "tcp://" + join(host, port)


def split(text: str) -> tuple[str, str]:
    """(host without brackets, port text) of ``host:port``, ``[v6]:port`` or either after
    ``tcp://``. Raises ValueError for text with no port or an unbracketed IPv6 literal."""
    rest = text[len("tcp://"):] if text.startswith("tcp://") else text
    if rest.startswith("["):
        host, sep, port = rest[1:].partition("]:")
        if not sep or not host:
            raise ValueError(f"{text!r}: an IPv6 address goes in brackets, e.g. tcp://[::1]:29500")
        ipaddress.IPv6Address(host)  # ValueError if it is not one (a zone, %eth0, is kept)
        return host, port
    host, sep, port = rest.rpartition(":")
    if not sep or ":" in host:
        raise ValueError(f"{text!r}: expected host:port (an IPv6 address in brackets, e.g. [::1]:29500)")
    return host, port


def literal(host: str) -> str | None:
    """``host`` as an IP address literal (brackets removed, a zone kept), or None if it is a name."""
    try:
        return str(ipaddress.ip_address(bare(host)))
    except ValueError:
        return None
