"""[ps]: the parameter server's shards, consistency mode, optimizer and durability."""
from __future__ import annotations

from dataclasses import dataclass

from commrt.runtime import addresses
from commrt.runtime.config.checks import (MAX_TIMEOUT_S, check_bytes, check_choice, check_non_negative,
                                          check_positive, check_seconds, check_types, invalid)

PS_MODES = ("sync", "async", "ssp")
PS_OPTIMIZERS = ("sgd", "adamw", "lamb")
PS_ON_WORKER_LOSS = ("error", "continue")


def _endpoint(addr: str) -> bool:
    """``tcp://host:port`` with a port ZeroMQ can use: 'tcp://h:abc' failed later as a bare
    ZMQError from connect, and 'tcp://h:99999' as a server that never answers."""
    if not addr.startswith("tcp://"):
        return False
    try:
        host, port = addresses.split(addr)
    except ValueError:
        return False
    return bool(host and port.isdecimal() and 0 < int(port) <= 65535)


@dataclass(frozen=True)
class PsConfig:
    servers: tuple[str, ...] = ()
    """One ``tcp://host:port`` per server shard; ``commrt server --index I`` serves entry I.
    In the environment: a comma-separated list."""
    workers: int = 0
    """How many workers push to the servers (the servers wait for all of them in sync mode)."""
    initial_workers: int = 0
    """async/ssp: how many workers (ids 0 to N-1) start with the job; the others join later, at
    the running step, and nobody waits for them until they do (0: all start with the job)."""
    mode: str = "sync"
    """sync: apply step t once every worker pushed it; async: apply each push as it arrives;
    ssp: like async, but no worker may run more than ``staleness`` steps ahead of the slowest."""
    staleness: int = 0
    """The SSP bound s (ssp mode only)."""
    optimizer: str = "sgd"
    """Server-side optimizer: sgd | adamw | lamb."""
    lr: float = 0.01
    """Learning rate of the server-side optimizer."""
    momentum: float = 0.0
    """SGD momentum (0 disables the buffer)."""
    nesterov: bool = False
    """SGD: Nesterov momentum."""
    weight_decay: float = 0.0
    """SGD: L2 added to the gradient; AdamW and LAMB: decoupled decay."""
    beta1: float = 0.9
    """AdamW / LAMB: decay of the first moment."""
    beta2: float = 0.999
    """AdamW / LAMB: decay of the second moment."""
    eps: float = 1e-8
    """AdamW / LAMB: added to the second moment's square root."""
    max_segment_bytes: int = 4 << 20
    """Tensors are split into key ranges of at most this many bytes (one frame each)."""
    timeout_s: float = 60.0
    """A server silent this long (no reply, no answer to a ping) is declared lost."""
    retry_s: float = 0.5
    """A client waiting on a reply pings the server this often; a restarted server answers
    'unknown' and the request is sent again (exactly-once makes that safe). At most half of
    ``timeout_s``."""
    worker_timeout_s: float = 30.0
    """How long a server waits for a lagging worker before applying ``on_worker_loss``."""
    on_worker_loss: str = "error"
    """error: waiting workers get PeerLost naming the missing worker; continue: drop it (logged)
    and go on with the rest."""
    checkpoint_dir: str = ""
    """Where servers keep their checkpoint and write-ahead log; empty disables durability."""
    checkpoint_every: int = 100
    """Updates between checkpoints (the write-ahead log covers the updates in between)."""
    max_log_bytes: int = 1 << 30
    """The log holds whole gradients (about a shard per update): once it grows past this many
    bytes the server checkpoints early, so its disk use stays near checkpoint + this bound."""
    fsync: bool = False
    """fsync the log before acknowledging (survives a machine crash, not only a process crash)."""
    metrics_port: int = 0
    """Serve Prometheus metrics (pushes, pulls, bytes, lag, SSP waits, apply latency) on this
    HTTP port (``commrt server --metrics-port``); 0: off."""
    metrics_addr: str = "127.0.0.1"
    """Where the metrics port binds: loopback unless set explicitly (the page is unauthenticated)."""

    def __post_init__(self) -> None:
        check_types("ps", self)
        check_choice("ps", "mode", self.mode, PS_MODES)
        check_choice("ps", "optimizer", self.optimizer, PS_OPTIMIZERS)
        check_choice("ps", "on_worker_loss", self.on_worker_loss, PS_ON_WORKER_LOSS)
        check_positive("ps", "lr", self.lr)
        check_positive("ps", "checkpoint_every", self.checkpoint_every)
        for name in ("max_segment_bytes", "max_log_bytes"):
            check_bytes("ps", name, getattr(self, name))
        for name in ("timeout_s", "retry_s", "worker_timeout_s"):
            check_seconds("ps", name, getattr(self, name), MAX_TIMEOUT_S)
        if self.retry_s > self.timeout_s / 2:  # a live server is heard only through the pings' answers
            raise invalid("ps", "retry_s", self.retry_s, f"must be at most half of timeout_s ({self.timeout_s:g}): "
                          "a waiting client would call a live server silent between two pings")
        for name in ("workers", "initial_workers", "staleness", "momentum", "weight_decay", "eps"):
            check_non_negative("ps", name, getattr(self, name))
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise invalid("ps", name, getattr(self, name), "must be in [0, 1)")
        if self.workers and self.initial_workers > self.workers:
            raise invalid("ps", "initial_workers", self.initial_workers, f"must be <= workers ({self.workers})")
        if self.mode == "sync" and 0 < self.initial_workers < self.workers:
            raise invalid("ps", "initial_workers", self.initial_workers,
                          "a sync job admits no worker after it began (every step averages the same workers): "
                          "use mode async or ssp")
        if not 0 <= self.metrics_port <= 65535:
            raise invalid("ps", "metrics_port", self.metrics_port, "valid: 0 (off) to 65535")
        for addr in self.servers:
            if not _endpoint(addr):
                raise invalid("ps", "servers", addr, "each entry must be 'tcp://host:port' (port 1-65535; an IPv6 "
                              "address in brackets: tcp://[::1]:5000)")

