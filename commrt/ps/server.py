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

from commrt.optim.spec import OptimSpec
from commrt.runtime import addresses
from commrt.runtime.config import Config
from commrt.runtime.errors import ConfigError, ProtocolError
from commrt.transport.security import check_bind, is_loopback
from commrt.transport.transport import Transport
from commrt.transport.memory import keep_freed_memory
from commrt.ps import protocol as P
from commrt.ps.core import ServerCore, StorageFailed
from commrt.ps.state import ShardState

log = logging.getLogger(__name__)
POLL_MS = 50


def optim_spec(cfg: Config) -> OptimSpec:
    ps = cfg.ps
    return OptimSpec(ps.optimizer, ps.lr, ps.momentum, ps.nesterov, ps.weight_decay,
                           ps.beta1, ps.beta2, ps.eps)


def split_address(addr: str) -> tuple[str, int]:
    host, port = addresses.split(addr)
    return host, int(port)


EXIT_STORAGE = 3  # serve()'s status when a durable write failed (the process's exit code)


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
        host, port = split_address(self.addr)
        check_bind(cfg, [host])
        self.core = ServerCore(ps, index, ShardState(optim_spec(cfg), ps.workers), connected=self._connected)
        self._recover(resume)
        self._stop = threading.Event()
        self.transport = Transport(cfg, f"server{index}")  # its Guard is up before the bind
        try:
            # a silent stranger's handshake is dropped after timeout_s
            self.sock, _ = self.transport.listen(zmq.ROUTER, host, port, handshake_s=ps.timeout_s,
                                                 max_frame=ps.max_segment_bytes + (4 << 20))
        except zmq.ZMQError as exc:
            self.transport.close()
            raise ConfigError(f"server {index} cannot listen on {self.addr}: {exc}") from None
        self.sock.setsockopt(zmq.LINGER, 1000)  # the last replies still leave on stop
        self._names: dict[bytes, str] = {}  # ROUTER identity -> peer name, for the counters
        self.metrics = self._serve_metrics(ps.metrics_addr, ps.metrics_port, index)

    def _connected(self, ident: bytes) -> bool:
        """Whether the connection ``ident`` is still open: ROUTER_MANDATORY makes a send to a
        closed one fail (EHOSTUNREACH) instead of dropping it. The probe is a 'pending' answer
        to request id 0, which no client uses: a live one reads it and ignores it."""
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            self.sock.send_multipart([ident, P.encode_reply(P.PENDING, 0, [])], zmq.NOBLOCK)
            return True
        except zmq.ZMQError as exc:
            return exc.errno != zmq.EHOSTUNREACH  # EAGAIN: its queue is full, so it is there
        finally:
            self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)

    def _serve_metrics(self, addr: str, port: int, index: int):
        """Shard I serves on ``port + I``, so one config fits every shard of a host; None when off."""
        if not port:
            return None
        from commrt.ps.metrics import MetricsServer  # prometheus_client only where metrics are asked for
        if not is_loopback(addr):
            log.warning("server %d: metrics page on %s is reachable from other hosts (unauthenticated)", index, addr)
        try:
            if port + index > 65535:  # bind() would raise OverflowError
                raise ConfigError(f"server {index} would serve metrics on port {port} + {index} = "
                                  f"{port + index}, beyond 65535: lower [ps] metrics_port")
            return MetricsServer(self.core.stats, addr, port + index)
        except ConfigError:
            self.sock.close()
            self.transport.close()
            raise

    def _recover(self, resume: bool) -> None:
        core, where = self.core, self.core.cfg.checkpoint_dir
        if resume and core.has_checkpoint():
            try:
                n = core.resume()
            except (ValueError, KeyError, TypeError, ProtocolError) as exc:  # another config's, or damaged
                raise ConfigError(f"server {core.index} cannot resume from {core.ckpt_path}: {exc}") from None
            log.info("server %d resumed at version %d (%d updates replayed from the log)",
                     core.index, core.state.version, n)
        elif resume and core.never_committed():
            log.warning("server %d: --resume found nothing committed in '%s' (the first checkpoint "
                        "never completed); starting fresh", core.index, where)
            core.start_fresh()
        elif resume:
            raise ConfigError(f"--resume: no checkpoint for server {core.index} in '{where}'")
        elif core.has_checkpoint():
            raise ConfigError(f"server {core.index} has a checkpoint in '{where}': pass --resume "
                              "to continue from it, or remove it to start afresh")

    def stop(self, *_args) -> None:
        self._stop.set()

    def serve(self, duration_s: float | None = None) -> int:
        """Serve until ``stop()`` (SIGTERM/SIGINT when run as a process), then checkpoint.
        Returns 0, or EXIT_STORAGE when a durable write failed (the workers were told why)."""
        end = None if duration_s is None else time.monotonic() + duration_s
        log.info("server %d listening on %s (%s mode, %s, %d workers)", self.core.index, self.addr,
                 self.core.cfg.mode, self.core.state.spec.kind, self.core.state.workers)
        try:
            while not self._stop.is_set() and self.core.failure is None and (
                    end is None or time.monotonic() < end):
                self._send(self._receive() + self.core.tick(time.monotonic()))
            if self.core.failure is None:
                self.core.checkpoint()
        except StorageFailed as exc:  # the final checkpoint
            log.error("server %d: %s", self.core.index, exc)
            return EXIT_STORAGE
        finally:
            self.core.close()
            self.sock.close()
            self.transport.close()
            if self.metrics is not None:
                self.metrics.close()
        return EXIT_STORAGE if self.core.failure is not None else 0

    def _receive(self) -> list:
        replies = []
        if not self.sock.poll(POLL_MS):
            return replies
        for _ in range(64):  # drain a burst before looking at deadlines
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            if len(frames) < 2:
                continue
            peer = self.transport.peer_of(frames[1])
            ident = frames[0].bytes
            if len(self._names) > 4096:  # identities of closed connections: bounded, not precious
                self._names.clear()
            name = self._names.setdefault(ident, peer or "anonymous")
            counter = self.transport.counters.peer(name)
            counter.recv_msgs += 1
            counter.recv_bytes += sum(len(f) for f in frames[1:])
            replies += self.core.handle(ident, [f.buffer for f in frames[1:]], time.monotonic(), peer)
        return replies

    def _send(self, replies: list) -> None:
        for ident, out in replies:
            counter = self.transport.counters.peer(self._names.get(ident, "unknown"))
            counter.sent_msgs += 1
            counter.sent_bytes += sum(len(f) for f in out)
            self.sock.send_multipart([ident, *out], copy=len(out) == 1)


def install_signal_handlers(server: Server) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, server.stop)
