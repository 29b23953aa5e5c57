"""The worker side of the parameter server: ``PSClient``.

Every tensor is cut into segments by ``partition`` (the same on every worker); a call sends one
message per server, all at once, and waits for every reply. While it waits it pings each server
every ``retry_s``: a live server answers "pending"; one that restarted answers "unknown" and the
request is sent again (safe: pushes are identified by (worker, step) and applied exactly once);
one silent for ``timeout_s`` becomes ``PeerLost`` naming the server.
"""
from __future__ import annotations

import itertools
import logging
import os
import time
from typing import Mapping

import numpy as np
import torch
import zmq

from ..config import Config, load_config
from ..dtypes import as_tensor, code_of
from ..errors import ConfigError, PeerLost, ProtocolError, RequestRejected
from ..security import Guard
from ..transport.memory import keep_freed_memory
from ..work import Executor, Work
from . import protocol as P
from .partition import Segment, TensorSpec, partition

log = logging.getLogger(__name__)
Tensors = Mapping[str, "torch.Tensor | np.ndarray"]
ZERO_COPY_MIN = 64 << 10


def _flat(t) -> torch.Tensor:
    return as_tensor(t).detach().reshape(-1)


class PSClient:
    def __init__(self, config: Config | None = None, worker: int | None = None,
                 environ: Mapping[str, str] = os.environ):
        self.cfg = config or load_config()
        ps = self.cfg.ps
        if not ps.servers:
            raise ConfigError("[ps] servers is empty: list one tcp://host:port per server (COMMRT_PS_SERVERS)")
        if worker is None:
            worker = self.cfg.cluster.rank if self.cfg.cluster.rank >= 0 else int(environ.get("RANK", "-1"))
        if worker < 0:
            raise ConfigError("the worker id is unknown: pass worker=, set [cluster] rank or RANK")
        self.worker, self.step = worker, 0
        if self.cfg.comm.keep_freed_memory:
            keep_freed_memory()  # large pushes and pulls reuse pages
        self.segments: list[Segment] = []
        self._local: list[list[int]] = []  # per server: global segment index of each local id
        self._ids = itertools.count(1)
        self._exec = Executor(f"ps-worker{worker}")
        self.ctx = zmq.Context()
        self.guard = Guard(self.ctx, self.cfg, f"rank{worker}")
        self._socks = [self._connect(addr, f"server{k}") for k, addr in enumerate(ps.servers)]
        self._poller = zmq.Poller()
        for s in self._socks:
            self._poller.register(s, zmq.POLLIN)

    def _connect(self, addr: str, name: str) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        self.guard.client(sock, name)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.cfg.ps.max_segment_bytes + (4 << 20))
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(self.cfg.comm.heartbeat_s * 1000))
        sock.connect(addr)
        return sock

    # -- public API -------------------------------------------------------------------------
    def init(self, params: Tensors) -> None:
        """Register the parameters. Worker 0 seeds the servers with its values; the others wait
        until it has, then should ``pull`` them. Restarted workers learn their step here."""
        specs = []
        for name, t in params.items():
            flat = _flat(t)
            specs.append(TensorSpec(name, flat.numel(), flat.element_size(), code_of(flat.dtype)))
        self.segments = partition(specs, len(self._socks), self.cfg.ps.max_segment_bytes,
                                  whole_tensors=self.cfg.ps.optimizer == "lamb")
        self._local = [[i for i, s in enumerate(self.segments) if s.server == k]
                       for k in range(len(self._socks))]
        self._shapes = {name: tuple(as_tensor(t).shape) for name, t in params.items()}
        self._dtypes = {s.name: s.dtype for s in specs}
        seed = self.worker == 0
        flats = {name: _flat(t).contiguous() for name, t in params.items()} if seed else {}
        reqs = {}
        for k, glob in enumerate(self._local):
            body = [seed, [[self.segments[g].name, self.segments[g].start, self.segments[g].stop,
                            self.segments[g].dtype] for g in glob]]
            frames = [self._frame(flats[self.segments[g].name], self.segments[g]) for g in glob] if seed else []
            reqs[k] = (body, frames)
        replies = self._exchange(P.INIT, self.step, reqs)
        self.step = min(r.body[1] for r, _ in replies.values())

    def push(self, grads: Tensors) -> None:
        self._exec.run("ps.push", lambda: self._push(grads, None), self.cfg.ps.timeout_s * 10)

    def pull(self, into: Tensors) -> None:
        self._exec.run("ps.pull", lambda: self._pull(into), self.cfg.ps.timeout_s * 10)

    def push_pull(self, grads: Tensors, into: Tensors) -> None:
        self._exec.run("ps.push_pull", lambda: self._push(grads, into), self.cfg.ps.timeout_s * 10)

    def push_async(self, grads: Tensors) -> Work:
        return self._exec.submit("ps.push", lambda: self._push(grads, None))

    def pull_async(self, into: Tensors) -> Work:
        return self._exec.submit("ps.pull", lambda: self._pull(into))

    def push_pull_async(self, grads: Tensors, into: Tensors) -> Work:
        return self._exec.submit("ps.push_pull", lambda: self._push(grads, into))

    def stats(self) -> list[dict]:
        """Each server's counters (pushes, pulls, bytes, version, staleness histogram, lag)."""
        replies = self._exchange(P.STATS, 0, {k: ([], []) for k in range(len(self._socks))})
        return [replies[k][0].body for k in range(len(self._socks))]

    def close(self) -> None:
        self._exec.close()
        for s in self._socks:
            s.close(linger=0)
        self.guard.close()
        self.ctx.term()

    # -- requests ---------------------------------------------------------------------------
    def _selected(self, tensors: Tensors) -> dict[int, list[tuple[int, int]]]:
        """Per server: (local id, global index) of every segment of the named tensors."""
        if not self.segments:
            raise ConfigError("call init(params) before push/pull")
        unknown = [n for n in tensors if n not in self._dtypes]
        if unknown:
            raise KeyError(f"unknown parameter(s) {unknown[:5]}; init registered {list(self._dtypes)[:5]}...")
        for name, t in tensors.items():
            t = as_tensor(t)
            if tuple(t.shape) != self._shapes[name] or code_of(t.dtype) != self._dtypes[name]:
                raise ValueError(f"{name}: expected shape {self._shapes[name]} and the parameter's "
                                 f"dtype, got {tuple(t.shape)} {t.dtype}")
        return {k: [(lid, g) for lid, g in enumerate(glob) if self.segments[g].name in tensors]
                for k, glob in enumerate(self._local)}

    def _frame(self, flat: torch.Tensor, seg: Segment):
        view = flat[seg.start:seg.stop].numpy()
        return view if view.nbytes >= ZERO_COPY_MIN else view.tobytes()

    def _push(self, grads: Tensors, into: Tensors | None) -> None:
        sel = self._selected(grads)
        flats = {name: _flat(g).contiguous() for name, g in grads.items()}
        reqs = {k: ([lid for lid, _ in pairs], [self._frame(flats[self.segments[g].name], self.segments[g])
                                                 for _, g in pairs]) for k, pairs in sel.items()}
        # every server hears of every step (if need be with no segments): a worker's step is one
        # clock across all shards, which is what exactly-once and the sync/SSP rules count
        replies = self._exchange(P.PUSHPULL if into is not None else P.PUSH, self.step, reqs)
        self.step += 1
        if into is not None:
            self._unpack(into, sel, replies)

    def _pull(self, into: Tensors) -> None:
        sel = self._selected(into)
        reqs = {k: ([lid for lid, _ in pairs], []) for k, pairs in sel.items() if pairs}
        self._unpack(into, sel, self._exchange(P.PULL, self.step, reqs))

    def _unpack(self, into: Tensors, sel: dict, replies: dict) -> None:
        targets = {}
        for name, t in into.items():
            t = as_tensor(t)
            targets[name] = (t, t.view(-1) if t.is_contiguous() else torch.empty(t.numel(), dtype=t.dtype))
        for k, pairs in sel.items():
            if not pairs:
                continue
            reply, frames = replies[k]
            if reply.body[1] != [lid for lid, _ in pairs] or len(frames) != len(pairs):
                raise ProtocolError(f"server {k} answered a pull with other segments than asked")
            for (_, g), frame in zip(pairs, frames):
                seg = self.segments[g]
                dst = targets[seg.name][1][seg.start:seg.stop].numpy()
                if len(frame) != dst.nbytes:
                    raise ProtocolError(f"server {k} sent {len(frame)} bytes for {seg.name}[{seg.start}:{seg.stop}]")
                np.copyto(dst, np.frombuffer(frame.buffer, dtype=dst.dtype))
        for t, flat in targets.values():
            if not t.is_contiguous():
                t.copy_(flat.view(t.shape))

    def _exchange(self, op: int, step: int, reqs: dict[int, tuple[list, list]]) -> dict:
        """Send one request per server, wait for every answer (see the module docstring)."""
        what = f"ps.{P.OP_NAMES[op]}"
        now = time.monotonic()
        pending = {}
        for k, (body, frames) in reqs.items():
            rid = next(self._ids)
            head = P.encode_request(op, self.worker, step, rid, body)
            self._socks[k].send_multipart([head, *frames], copy=False)
            pending[k] = [rid, head, frames, now, now]  # id, header, frames, last heard, last ping
        done = {}
        while pending:
            events = dict(self._poller.poll(int(self.cfg.ps.retry_s * 1000)))
            now = time.monotonic()
            for k in list(pending):
                if self._socks[k] in events:
                    self._receive(k, pending, done, now, what, step)
            for k, entry in pending.items():
                if now - entry[3] > self.cfg.ps.timeout_s:
                    raise PeerLost(k, what, step, f"{self.cfg.ps.servers[k]} silent for "
                                   f"{self.cfg.ps.timeout_s:g}s", role="server")
                if now - entry[4] >= self.cfg.ps.retry_s:
                    self._socks[k].send(P.encode_request(P.PING, self.worker, step, entry[0], []))
                    entry[4] = now
        return done

    def _receive(self, k: int, pending: dict, done: dict, now: float, what: str, step: int) -> None:
        sock = self._socks[k]
        while k in pending:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                reply = P.decode_reply(frames[0].buffer)
            except ProtocolError as exc:
                log.warning("worker %d: dropped a malformed reply from server %d: %s", self.worker, k, exc)
                continue
            entry = pending[k]
            if reply.req_id != entry[0]:
                continue  # a late answer to an earlier request
            entry[3] = now
            if reply.status == P.PENDING:
                continue
            if reply.status == P.UNKNOWN:  # the server restarted and lost it: send it again
                log.warning("worker %d: server %d lost %s step %d; sending it again", self.worker, k, what, step)
                sock.send_multipart([entry[1], *entry[2]], copy=False)
                continue
            del pending[k]
            if reply.status == P.ERROR:
                raise RequestRejected(k, f"{what} step {step}", str(reply.body[0]))
            if reply.status == P.LOST:
                missing = reply.body[1] or [-1]
                raise PeerLost(missing[0], what, step, str(reply.body[0]), role="worker")
            done[k] = (reply, frames[1:])
