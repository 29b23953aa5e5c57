"""[comm], [cluster] and [security]: how ranks find each other and talk."""
from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlparse

from commrt.runtime.config.checks import (MAX_HEARTBEAT_S, MAX_TIMEOUT_S, check_at_least, check_bytes,
                                          check_choice, check_seconds, check_types, invalid)

BACKEND_NAMES = ("auto", "zmq", "gloo", "nccl")
HIERARCHICAL_MODES = ("auto", "always", "never")
INTRA_NODE_MODES = ("auto", "shm", "tcp")
SECURITY_MODES = ("secret", "curve", "none")
ALGORITHM_CHOICES = {
    "all_reduce": ("rabenseifner", "recursive_doubling", "ring"),
    "broadcast": ("binomial", "chain"),
    "reduce": ("binomial", "ring"),
    "all_gather": ("bruck", "ring"),
    "all_to_all": ("pairwise",),
    "barrier": ("dissemination",),
}
"""The schedules each collective has (collectives/schedules.py's ALGORITHMS; a unit test keeps the
two equal: this layer sits below the collectives and cannot import them)."""
_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "k": 1 << 10, "mib": 1 << 20, "m": 1 << 20, "gib": 1 << 30, "g": 1 << 30}


def _bytes(text: str, entry: str) -> int | None:
    text = text.strip().lower().replace(" ", "")
    if not text:
        return None
    digits = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(digits):]
    if not digits.isdecimal() or unit not in _UNITS:  # isdigit() takes "²", which int() refuses
        raise invalid("comm", "algorithms", entry, f"size {text!r}: expected an integer with an optional unit "
                      "(B, KiB, MiB, GiB)")
    return int(digits) * _UNITS[unit]


def parse_algorithms(text: str) -> dict[str, list[dict]]:
    """``[comm] algorithms`` as selection.table_from's overrides. The text is entries separated by
    commas, each ``collective=algorithm`` (every size) or ``collective=algorithm@MIN-MAX`` (sizes
    in [MIN, MAX); either bound may be left out; units B, KiB, MiB, GiB). ConfigError names
    what is valid."""
    out: dict[str, list[dict]] = {}
    for entry in (e.strip() for e in text.replace(";", ",").split(",")):
        if not entry:
            continue
        collective, eq, rest = (p.strip() for p in entry.partition("="))
        algorithm, at, sizes = (p.strip() for p in rest.partition("@"))
        if not eq or collective not in ALGORITHM_CHOICES:
            raise invalid("comm", "algorithms", entry, f"expected collective=algorithm[@MIN-MAX]; collectives: "
                          f"{list(ALGORITHM_CHOICES)}")
        if algorithm not in ALGORITHM_CHOICES[collective]:
            raise invalid("comm", "algorithms", entry, f"valid for {collective}: {list(ALGORITHM_CHOICES[collective])}")
        rule: dict = {"algorithm": algorithm}
        if at:
            low, dash, high = sizes.partition("-")
            if not dash:
                raise invalid("comm", "algorithms", entry, "a size range is MIN-MAX (either may be empty)")
            rule.update(min_bytes=_bytes(low, entry) or 0, max_bytes=_bytes(high, entry))
            if rule["max_bytes"] is not None and rule["max_bytes"] <= rule["min_bytes"]:
                raise invalid("comm", "algorithms", entry, "the size range MIN-MAX (MAX excluded) is empty")
        out.setdefault(collective, []).append(rule)
    return out


@dataclass(frozen=True)
class CommConfig:
    backend: str = "auto"
    """Which backend runs the collectives: auto | zmq | gloo | nccl. ``auto`` picks NCCL when
    CUDA is usable and every local rank has its own GPU, else ZMQ."""
    timeout_s: float = 300.0
    """Deadline for every blocking wait (a receive, a send that cannot drain, init)."""
    chunk_bytes: int = 4 << 20
    """Payloads are pipelined in pieces of at most this many bytes (pyzmq slows down on very
    large single messages, and small pieces let send, receive and reduce overlap)."""
    small_bytes: int = 64 << 10
    """Tensors up to this size take a one-step path instead of the bandwidth-optimal ring:
    reduce_scatter's direct exchange on TCP, the shared-memory all_reduce's single step. The
    other collectives on TCP follow the selection table (``algorithms``)."""
    max_frame_bytes: int = 64 << 20
    """Largest single frame a socket accepts (ZMQ_MAXMSGSIZE); must exceed chunk_bytes."""
    shm_slot_bytes: int = 4 << 20
    """The shared-memory path's step: each rank's segment holds two slots of this size, and a
    larger payload crosses in rounds of it (fewer, larger rounds: fewer times every rank waits
    for the slowest; each rank maps 2x this per local rank). A multiple of 4096 from 64 KiB to
    1 GiB. All ranks must agree."""
    heartbeat_s: float = 1.0
    """ZMTP heartbeat interval: a peer silent for 3 intervals is declared lost."""
    keep_freed_memory: bool = False
    """Let this process reuse freed multi-MiB buffers instead of returning them to the kernel
    (glibc's malloc thresholds, set once per process): without it every received piece is
    page-faulted in afresh, about a tenth of a rank's CPU at 64 MiB. Freed memory then stays
    in the process, as with any caching allocator. Off by default because it changes the whole
    process; ``commrt launch`` gives its ranks the same thresholds through GLIBC_TUNABLES
    (``COMMRT_COMM_KEEP_FREED_MEMORY=0`` in its environment turns that off)."""
    check_call_sites: bool = False
    """Debug aid (like TORCH_DISTRIBUTED_DEBUG=DETAIL): each collective also carries a hash of
    the source line that called it, so a rank that skipped a collective is caught even when the
    next one looks the same; under `hierarchical = "auto"` a two-level op first passes a world
    barrier, so ranks whose sizes sent them different ways raise CollectiveMismatch instead of
    waiting out the deadline. Off by default: correct programs may call one collective from
    different lines on different ranks, and the barrier costs a two-level op 1.5-1.9x."""
    hierarchical: str = "auto"
    """Collectives over the world group when it spans several nodes with several ranks on each:
    ``always`` runs all_reduce, reduce_scatter_tensor and all_gather_into_tensor in two levels
    (inside each node, then across nodes on 1/M of the data), ``never`` flat, ``auto``
    hierarchically above small_bytes per rank's cross-node part when a one-time probe (mesh.py)
    finds two levels >= 1.1x faster (comm_stats()["hierarchical_auto"]). All ranks must agree."""
    algorithms: str = ""
    """Pin schedules ahead of the built-in selection table (``commrt config`` prints the table
    in force): comma-separated ``collective=algorithm`` or ``collective=algorithm@MIN-MAX``
    (sizes in [MIN, MAX), units B/KiB/MiB/GiB, a bound may be left out), e.g.
    ``"all_reduce=ring@1MiB-, broadcast=binomial"``; the first matching entry wins. Algorithms:
    all_reduce recursive_doubling | rabenseifner | ring, broadcast binomial | chain, reduce
    binomial | ring, all_gather bruck | ring, all_to_all pairwise, barrier dissemination. The
    TCP path only (shared memory has its own). All ranks must agree."""
    intra_node: str = "auto"
    """How ranks of one node (one host and network namespace) exchange collective payloads:
    ``auto`` through shared memory where the host allows it (Linux on x86-64: memfd_create and
    abstract Unix sockets; nothing in /dev/shm), else TCP; ``shm`` shared memory or an error;
    ``tcp`` always the zmq/TCP path. All ranks must agree."""

    def __post_init__(self) -> None:
        check_types("comm", self)
        check_choice("comm", "backend", self.backend, BACKEND_NAMES)
        check_choice("comm", "hierarchical", self.hierarchical, HIERARCHICAL_MODES)
        check_choice("comm", "intra_node", self.intra_node, INTRA_NODE_MODES)
        parse_algorithms(self.algorithms)
        for name in ("chunk_bytes", "small_bytes", "max_frame_bytes"):
            check_bytes("comm", name, getattr(self, name))
        check_seconds("comm", "timeout_s", self.timeout_s, MAX_TIMEOUT_S)
        check_seconds("comm", "heartbeat_s", self.heartbeat_s, MAX_HEARTBEAT_S)
        if not (64 << 10 <= self.shm_slot_bytes <= 1 << 30 and self.shm_slot_bytes % 4096 == 0):
            raise invalid("comm", "shm_slot_bytes", self.shm_slot_bytes,
                          "it must be a multiple of 4096 from 65536 (64 KiB) to 1073741824 (1 GiB)")
        if self.max_frame_bytes < self.chunk_bytes + 4096:
            raise invalid("comm", "max_frame_bytes", self.max_frame_bytes,
                          f"it must exceed chunk_bytes ({self.chunk_bytes}) by at least 4096")


def _tcp_url(text: str) -> bool:
    """``tcp://host:port`` as rendezvous.resolve reads it (urllib: host and a port in 1-65535)."""
    if not text.startswith("tcp://"):
        return False
    url = urlparse(text)
    try:  # .port raises ValueError for a port that is not a number or beyond 65535
        return bool(url.hostname and url.port)
    except ValueError:
        return False


@dataclass(frozen=True)
class ClusterConfig:
    rendezvous: str = "env://"
    """Where ranks meet: ``env://`` (torchrun variables) or ``tcp://host:port``."""
    world_size: int = 0
    """Number of ranks; 0 means: take it from the environment (WORLD_SIZE)."""
    rank: int = -1
    """This process's rank; -1 means: take it from the environment (RANK)."""
    bind_host: str = "127.0.0.1"
    """Interface the data-plane sockets bind to. Loopback unless told otherwise."""
    advertise_host: str = ""
    """Address peers use to reach this rank; empty means the same as bind_host."""
    store_proxy: bool = True
    """A zmq world with the launcher's node variables and more than one node reaches rank 0's
    bootstrap store through one proxy per node, served by the node's local rank 0 (rank 0 then
    holds one store connection per node, not per rank; if that rank dies, its node's ranks
    cannot reach the store). false: every rank connects to rank 0's store. All ranks must agree."""

    def __post_init__(self) -> None:
        check_types("cluster", self)
        check_at_least("cluster", "world_size", self.world_size, 0)
        check_at_least("cluster", "rank", self.rank, -1)
        if not (self.rendezvous == "env://" or _tcp_url(self.rendezvous)):
            raise invalid("cluster", "rendezvous", self.rendezvous,
                          "valid: 'env://' or 'tcp://host:port' (port 1-65535)")
        if not self.bind_host:
            raise invalid("cluster", "bind_host", self.bind_host, "give an interface's address (e.g. '127.0.0.1')")



@dataclass(frozen=True)
class SecurityConfig:
    mode: str = "secret"
    """Peer authentication on every TCP socket:
    secret (default): ZeroMQ PLAIN checked by a ZAP handler against a job secret; costs one
    check per connection, nothing per message, but the secret crosses the wire in the clear,
    so it is for loopback and trusted fabrics. curve: ZeroMQ CURVE, encrypted, each process
    holds a key pair and only keys on the job's allow-list get in. none: no authentication."""
    secret_file: str = ""
    """For secret: where the job secret is read when $COMMRT_JOB_SECRET is not set (``commrt
    launch`` sets a fresh one per job). Empty: ~/.config/commrt/job_secret, created (mode 0600)
    on first use, so all of one user's processes on this host share it and other users have none."""
    keys_dir: str = ""
    """For curve: the directory ``commrt keygen`` wrote (allow.txt and one .key per process).
    ``commrt launch`` makes a throw-away one for its job when this is empty."""
    allow_insecure: bool = False
    """Permit binding a non-loopback interface without encryption (none or secret mode; logged
    loudly): for a trusted fabric only."""

    def __post_init__(self) -> None:
        check_types("security", self)
        check_choice("security", "mode", self.mode, SECURITY_MODES)

