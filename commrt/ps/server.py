"""A server shard's process loop: a ROUTER socket in front of ``ServerCore``.

One thread does everything (receive, apply, reply), so updates to a key never race: the
"one update at a time per key" rule of the async mode holds by construction.
"""
from __future__ import annotations

import logging
import signal
import threading
import time

import zmq

from .. import optim
from ..config import Config
from ..errors import ConfigError
from ..security import Guard, check_bind
from ..transport.memory import keep_freed_memory
from .core import ServerCore
from .state import ShardState

log = logging.getLogger(__name__)
POLL_MS = 50


def optim_spec(cfg: Config) -> optim.OptimSpec:
    ps = cfg.ps
    return optim.OptimSpec(ps.optimizer, ps.lr, ps.momentum, ps.nesterov, ps.weight_decay,
                           ps.beta1, ps.beta2, ps.eps)


def split_address(addr: str) -> tuple[str, int]:
    host, _, port = addr[len("tcp://"):].rpartition(":")
    return host, int(port)


class Server:
    def __init__(self, cfg: Config, index: int, resume: bool = False):
        ps = cfg.ps
        if not 0 <= index < len(ps.servers):
            raise ConfigError(f"server index {index} is invalid; [ps] servers lists {len(ps.servers)}")
        if ps.workers < 1:
            raise ConfigError("[ps] workers must be set (COMMRT_PS_WORKERS) for a server")
        self.addr = ps.servers[index]
        if cfg.comm.keep_freed_memory:
            keep_freed_memory()  # large pushes and pulls reuse pages
        check_bind(cfg, [split_address(self.addr)[0]])
        self.core = ServerCore(ps, index, ShardState(optim_spec(cfg), ps.workers))
        if resume:
            if not self.core.has_checkpoint():
                raise ConfigError(f"--resume: no checkpoint for server {index} in '{ps.checkpoint_dir}'")
            n = self.core.resume()
            log.info("server %d resumed at version %d (%d updates replayed from the log)",
                     index, self.core.state.version, n)
        elif self.core.has_checkpoint():
            raise ConfigError(f"server {index} has a checkpoint in '{ps.checkpoint_dir}': pass --resume "
                              "to continue from it, or remove it to start afresh")
        self._stop = threading.Event()
        self.ctx = zmq.Context()
        self.guard = Guard(self.ctx, cfg, f"server{index}")  # before the bind
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.guard.server(self.sock)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.setsockopt(zmq.MAXMSGSIZE, ps.max_segment_bytes + (4 << 20))
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, int(cfg.comm.heartbeat_s * 1000))
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(3 * cfg.comm.heartbeat_s * 1000))
        self.sock.setsockopt(zmq.HANDSHAKE_IVL, int(ps.timeout_s * 1000))  # a silent stranger is dropped
        try:
            self.sock.bind(self.addr)
        except zmq.ZMQError as exc:
            self.sock.close()
            raise ConfigError(f"server {index} cannot listen on {self.addr}: {exc}") from None

    def stop(self, *_args) -> None:
        self._stop.set()

    def serve(self, duration_s: float | None = None) -> None:
        """Serve until ``stop()`` (SIGTERM/SIGINT when run as a process), then checkpoint."""
        end = None if duration_s is None else time.monotonic() + duration_s
        log.info("server %d listening on %s (%s mode, %s, %d workers)", self.core.index, self.addr,
                 self.core.cfg.mode, self.core.state.spec.kind, self.core.state.workers)
        try:
            while not self._stop.is_set() and (end is None or time.monotonic() < end):
                replies = []
                if self.sock.poll(POLL_MS):
                    for _ in range(64):  # drain a burst before looking at deadlines
                        try:
                            frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        if len(frames) >= 2:
                            replies += self.core.handle(frames[0].bytes, [f.buffer for f in frames[1:]],
                                                        time.monotonic(), self.guard.peer_of(frames[1]))
                replies += self.core.tick(time.monotonic())
                for ident, out in replies:
                    self.sock.send_multipart([ident, *out], copy=len(out) == 1)
        finally:
            self.core.checkpoint()
            self.sock.close()
            self.guard.close()
            self.ctx.term()


def install_signal_handlers(server: Server) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, server.stop)
