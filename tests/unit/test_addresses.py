"""Host and port in IPv4 and IPv6 form (commrt.runtime.addresses) and the settings that read them."""
from __future__ import annotations

import pytest

from commrt.runtime import addresses, rendezvous
from commrt.runtime.config import load_config
from commrt.runtime.errors import ConfigError
from commrt.transport import security


@pytest.mark.parametrize("host,port,joined", [("127.0.0.1", 5, "127.0.0.1:5"), ("::1", 5, "[::1]:5"),
                                              ("[::1]", "7", "[::1]:7"), ("node-3", 9, "node-3:9"),
                                              ("fe80::1%eth0", 1, "[fe80::1%eth0]:1")])
def test_join_brackets_ipv6_literals_only(host, port, joined):
    assert addresses.join(host, port) == joined
    assert addresses.tcp_url(host, port) == "tcp://" + joined
    assert addresses.split(addresses.tcp_url(host, port)) == (addresses.bare(host), str(port))
    assert addresses.split(joined) == (addresses.bare(host), str(port))


@pytest.mark.parametrize("text", ["tcp://::1:5000", "::1:5000", "tcp://[::1]5000", "tcp://[]:5", "[nothost]:5",
                                  "tcp://localhost"])
def test_split_refuses_an_unbracketed_ipv6_or_a_missing_port(text):
    with pytest.raises(ValueError):
        addresses.split(text)


def test_literal_and_family():
    assert addresses.literal("[::1]") == "::1" and addresses.literal("127.0.0.1") == "127.0.0.1"
    assert addresses.literal("localhost") is None and addresses.literal("fe80::1%eth0") == "fe80::1%eth0"
    assert addresses.is_ipv6("::1") and addresses.is_ipv6("[::1]") and not addresses.is_ipv6("host")


def test_ps_servers_take_bracketed_ipv6_only():
    cfg = load_config(None, {"ps": {"servers": ["tcp://[::1]:5000", "tcp://127.0.0.1:5001"]}})
    assert cfg.ps.servers[0] == "tcp://[::1]:5000"
    for bad in ("tcp://::1:5000", "tcp://[::1]:0", "tcp://[::1]:x"):
        with pytest.raises(ConfigError, match="in brackets"):
            load_config(None, {"ps": {"servers": [bad]}})


def test_rendezvous_reads_ipv6_masters():
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "::1", "MASTER_PORT": "29501"}
    assert rendezvous.resolve("env://", None, None, env).host == "::1"
    spec = rendezvous.resolve("tcp://[::1]:29502", None, None, env)
    assert (spec.host, spec.port) == ("::1", 29502)
    assert rendezvous.resolve("env://", None, None, {**env, "MASTER_ADDR": "[::1]"}).host == "::1"


def test_ipv6_loopback_is_loopback_for_the_bind_check():
    assert security.is_loopback("::1") and security.is_loopback("[::1]")
    assert not security.is_loopback("2001:db8::1")
    security.check_bind(load_config(None, {}), ["::1"])  # loopback: no encryption needed
    with pytest.raises(ConfigError, match="refusing to listen"):
        security.check_bind(load_config(None, {}), ["2001:db8::1"])
