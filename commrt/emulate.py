"""An emulated cluster on one host: each node is a Linux network namespace with its own address
in 198.18.0.0/15 (RFC 2544's benchmarking range: never routed), joined by a bridge that lives in
a namespace of its own, so nothing of this is visible in the host's network.

Each node's link is shaped in both directions with ``tc``: a token bucket (tbf) to RATE, and,
for a DELAY, netem in front of it; under the tbf, small packets (TCP's ACKs) leave before bulk
data, as on a real NIC whose queue drains at line rate. Ranks of one node reach each other over their namespace's
loopback (a node's own address is local to it); ranks of different nodes only over the
shaped link.

Names carry the launcher's PID (``commrt-emu-<pid>-<nonce>-n0``): the namespaces are deleted
on every exit path (their veth ends and qdiscs go with them), and namespaces of a launcher
that no longer runs (killed with SIGKILL) are deleted when the next cluster is made.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import secrets
import shutil
import subprocess

from commrt.runtime.errors import CommError, ConfigError
from commrt.runtime.processes import _stop_on_signals

log = logging.getLogger(__name__)

PREFIX = "commrt-emu-"
SUBNET = "198.18.0"  # node i is SUBNET.(i+1)/24
MAX_NODES = 250
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps)$", re.I)
_DELAY = re.compile(r"^\d+(?:\.\d+)?(?:us|usec|ms|msec|s|sec)$", re.I)
_SCALE = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
          "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}


@dataclasses.dataclass(frozen=True)
class LinkShape:
    rate: str
    """tc rate, e.g. ``1gbit``."""
    delay: str | None = None
    """One-way delay added by netem on each direction, e.g. ``0.2ms``."""

    @property
    def bits_per_s(self) -> float:
        value, unit = _RATE.match(self.rate).groups()
        return float(value) * _SCALE[unit.lower()]


def parse_shape(spec: str) -> LinkShape:
    """``RATE[,DELAY]`` -> LinkShape, or a ConfigError saying what a valid one looks like."""
    parts = [p.strip() for p in spec.split(",")]
    if len(parts) > 2 or not _RATE.match(parts[0]) or (len(parts) == 2 and not _DELAY.match(parts[1])):
        raise ConfigError(f"--emulate-network {spec!r} is invalid; expected RATE[,DELAY] such as "
                          "'1gbit' or '1gbit,0.2ms' (rate units: bit kbit mbit gbit bps kbps mbps gbps)")
    shape = LinkShape(parts[0], parts[1] if len(parts) == 2 else None)
    if shape.bits_per_s <= 0:
        raise ConfigError(f"--emulate-network {spec!r}: the rate must be > 0")
    return shape


def node_address(node: int) -> str:
    return f"{SUBNET}.{node + 1}"


def _shape_commands(ns: str, dev: str, shape: LinkShape) -> list[list[str]]:
    """Egress shaping of ``dev`` in ``ns``. The bucket holds 10 ms of traffic (at least 64 KiB):
    tbf needs more than one timer tick's worth (HZ up to 1000) or it cannot reach the rate."""
    burst = max(64 << 10, int(shape.bits_per_s / 8 / 100))
    tbf = ["tbf", "rate", shape.rate, "burst", str(burst), "latency", "100ms"]
    tc = ["tc", "-n", ns]
    if shape.delay is None:
        return [[*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", *tbf],
                *_small_first(tc, dev, "1:1", shape)]
    return [[*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay", shape.delay],
            [*tc, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf],
            *_small_first(tc, dev, "10:1", shape)]


SMALL_PACKET = 128
"""IP packets shorter than this (TCP's pure ACKs, ~52-72 bytes) leave a node before its bulk data."""


def _small_first(tc: list[str], dev: str, parent: str, shape: LinkShape) -> list[list[str]]:
    """The queue under the tbf: two classes, small TCP packets first, the rest FIFO in at most
    100 ms of the rate. With one FIFO, a node sending bulk data queued the ACKs of the data it
    received behind up to 100 ms of its own: the peer's TCP, clocked by those ACKs, left its
    link idle (a 1 MiB exchange both ways between two nodes took 1.6-1.9x its bytes' time at
    100 Mbit; one way, on time). A real NIC drains at line rate, so its ACKs barely wait; here
    they go first, and the two directions of a link no longer slow each other."""
    fast = f"{int(shape.bits_per_s * 10)}bit"  # the classes never limit: the tbf above does
    limit = max(128 << 10, int(shape.bits_per_s / 8 / 10))
    cls = [*tc, "class", "add", "dev", dev, "parent", "20:"]
    return [[*tc, "qdisc", "add", "dev", dev, "parent", parent, "handle", "20:", "htb", "default", "2"],
            [*cls, "classid", "20:1", "htb", "rate", fast, "quantum", "60000", "prio", "0"],
            [*cls, "classid", "20:2", "htb", "rate", fast, "quantum", "60000", "prio", "1"],
            [*tc, "qdisc", "add", "dev", dev, "parent", "20:2", "handle", "22:", "bfifo", "limit", str(limit)],
            [*tc, "filter", "add", "dev", dev, "parent", "20:", "protocol", "ip", "prio", "1", "u32",
             "match", "ip", "protocol", "6", "0xff", "match", "u16", "0x0000", f"{0x10000 - SMALL_PACKET:#06x}",
             "at", "2", "flowid", "20:1"]]


CONGESTION_CONTROL = "reno"
"""Each node's TCP congestion control, set in its namespace, not inherited from the host. On a
host whose default is BBR (this one), BBR over the 12 us veth and the token bucket left a node
link idle 20-30% of the time in back-to-back collectives (stretches of 100-330 ms without a send;
doubling 1 MiB at 4 x 2, 100 Mbit: 506-605 ms per op, 351 with Reno, 350.8 the bytes' time), and
varied 7-15% from run to run (Reno: 0.5%). Reno is loss-based like the usual default, cubic, and
every kernel lets a namespace choose it (cubic may not be in tcp_allowed_congestion_control)."""


def plan(tag: str, nnodes: int, shape: LinkShape) -> tuple[list[str], list[list[str]]]:
    """Pure: (namespaces in creation order, commands that build the cluster)."""
    sw = f"{PREFIX}{tag}-sw"
    nodes = [f"{PREFIX}{tag}-n{i}" for i in range(nnodes)]
    cmds = [["ip", "netns", "add", sw], ["ip", "-n", sw, "link", "set", "lo", "up"],
            ["ip", "-n", sw, "link", "add", "br0", "type", "bridge"], ["ip", "-n", sw, "link", "set", "br0", "up"]]
    for i, ns in enumerate(nodes):
        port = f"n{i}"
        cmds += [["ip", "netns", "add", ns], ["ip", "-n", ns, "link", "set", "lo", "up"],
                 ["ip", "-n", sw, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns],
                 ["ip", "-n", sw, "link", "set", port, "master", "br0"], ["ip", "-n", sw, "link", "set", port, "up"],
                 ["ip", "-n", ns, "addr", "add", f"{node_address(i)}/24", "dev", "eth0"],
                 ["ip", "-n", ns, "link", "set", "eth0", "up"],
                 ["ip", "netns", "exec", ns, "sh", "-c",
                  f"echo {CONGESTION_CONTROL} > /proc/sys/net/ipv4/tcp_congestion_control"]]
        cmds += _shape_commands(ns, "eth0", shape) + _shape_commands(sw, port, shape)
    return [sw, *nodes], cmds


def check_usable(shape: LinkShape) -> None:
    """Root (CAP_NET_ADMIN) and iproute2's ``ip`` and ``tc``, or a ConfigError saying which is missing."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise ConfigError(f"--emulate-network needs iproute2 ({' and '.join(missing)} not found on PATH)")
    if os.geteuid() != 0:
        raise ConfigError("--emulate-network needs root (CAP_NET_ADMIN) to create network namespaces "
                          "and shape their links with tc; run it as root (CI does)")


COMMAND_TIMEOUT_S = 60.0
"""The most one ``ip`` or ``tc`` command may take; none takes a second on a working host."""


class CommandHung(CommError):
    """An ``ip`` / ``tc`` command of the emulated cluster did not finish within its timeout
    (it was killed; the namespaces made so far are deleted as on any other failure)."""

    def __init__(self, cmd: list[str], timeout: float):
        self.cmd, self.timeout = cmd, timeout
        super().__init__(f"emulated cluster: `{' '.join(cmd)}` did not finish within {timeout:g} s and was "
                         "killed (a hung iproute2 or kernel: see dmesg)")


def _call(cmd: list[str], timeout: float = COMMAND_TIMEOUT_S) -> subprocess.CompletedProcess:
    """``cmd``'s completed process; CommandHung past ``timeout`` (was subprocess's TimeoutExpired)."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise CommandHung(cmd, timeout) from None


def _run(cmd: list[str]) -> None:
    proc = _call(cmd)
    if proc.returncode != 0:
        err = proc.stderr.strip()
        if "netem" in cmd and ("unknown" in err.lower() or "no such file" in err.lower()):
            raise ConfigError("this kernel has no netem qdisc (sch_netem), so a DELAY cannot be emulated: "
                              f"give the rate alone (--emulate-network RATE); tc said: {err}")
        raise ConfigError(f"emulated cluster: `{' '.join(cmd)}` failed: {err}")


def _namespaces() -> list[str]:
    proc = _call(["ip", "netns", "list"], timeout=30)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.startswith(PREFIX)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_leftovers() -> list[str]:
    """Delete the namespaces of emulated clusters whose launcher is gone; returns their names."""
    gone = []
    for ns in _namespaces():
        m = re.match(rf"^{PREFIX}(\d+)-", ns)
        if m and not _alive(int(m.group(1))):
            why = _delete_one(ns)
            if why is None:
                gone.append(ns)
            else:
                log.warning("could not remove the namespace %s left by a killed emulated run: %s", ns, why)
    if gone:
        log.warning("removed %d network namespaces left by a killed emulated run: %s", len(gone), gone)
    return gone


@dataclasses.dataclass(frozen=True)
class Cluster:
    namespaces: tuple[str, ...]
    """One per node."""
    shape: LinkShape

    def wrap(self, node: int) -> tuple[list[str], dict]:
        """argv prefix and environment for a rank of ``node``: it binds and advertises the node's
        address (so ranks of other nodes reach it over the shaped link), and the job meets at
        node 0. The fabric exists only inside this run's namespaces, hence allow_insecure; the
        job secret and everything else travel in the environment, never on a command line."""
        env = {"COMMRT_CLUSTER_BIND_HOST": node_address(node), "COMMRT_CLUSTER_ADVERTISE_HOST": "",
               "COMMRT_SECURITY_ALLOW_INSECURE": "1", "COMMRT_EMULATED_NODE": str(node)}
        return ["ip", "netns", "exec", self.namespaces[node]], env


@contextlib.contextmanager
def cluster(nnodes: int, shape: LinkShape):
    """Create the namespaces, yield a ``Cluster``, delete them however the block ends."""
    if not 1 <= nnodes <= MAX_NODES:
        raise ConfigError(f"--nnodes {nnodes} is invalid for an emulated cluster; valid: 1..{MAX_NODES}")
    check_usable(shape)
    clean_leftovers()
    tag = f"{os.getpid()}-{secrets.token_hex(3)}"
    names, cmds = plan(tag, nnodes, shape)
    # SIGTERM/SIGHUP become Stopped from here on (launch() installs the same only for the run):
    # otherwise one during setup or teardown killed the process with the namespaces in place
    made: list[str] = []  # the namespaces that may exist: a setup that failed made only some
    with _stop_on_signals():
        try:
            for cmd in cmds:
                _build(cmd, made)
            log.info("emulated cluster: %d nodes at %s%s (namespaces %s)", nnodes, shape.rate,
                     f", {shape.delay} delay" if shape.delay else "", ", ".join(names))
            yield Cluster(tuple(names[1:]), shape)
        finally:  # deleting a namespace deletes its veth end (and so the pair) and its qdiscs
            _delete_all(list(reversed(made)))


def _build(cmd: list[str], made: list[str]) -> None:
    """Run one setup command, adding the namespace an ``ip netns add`` makes to ``made`` before
    it runs (a signal may land after the kernel made it) and taking it out again when the
    command failed (nothing was made: deleting it would be reported as a failure)."""
    adds = cmd[:3] == ["ip", "netns", "add"]
    if adds:
        made.append(cmd[3])
    try:
        _run(cmd)
    except ConfigError:
        if adds:
            made.pop()
        raise


def _delete_all(names: list[str]) -> None:
    """Delete every namespace of ``names``, each on its own: one that fails or hangs, or a signal
    or ^C arriving meanwhile, must not leave the rest behind. What could not be deleted is
    logged (the next emulated run deletes it, once this process is gone); an interruption is
    raised again when every one has been tried."""
    failed, interrupted = [], None
    for ns in names:
        for _ in range(2):  # once more when an interruption cut the first try short
            try:
                why = _delete_one(ns)
                break
            except BaseException as exc:  # Stopped, KeyboardInterrupt: finish the cleanup first
                interrupted, why = interrupted or exc, f"interrupted by {exc!r}"
        if why is not None:
            failed.append(f"{ns} ({why})")
    if failed:
        log.error("emulated cluster: could not delete %d network namespace(s): %s", len(failed), "; ".join(failed))
    if interrupted is not None:
        raise interrupted


def _delete_one(ns: str) -> str | None:
    """Delete namespace ``ns``: None, or why it failed."""
    try:
        proc = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:  # TimeoutExpired included
        return f"{type(exc).__name__}: {exc}"
    return None if proc.returncode == 0 else (proc.stderr.strip() or f"exit status {proc.returncode}")
