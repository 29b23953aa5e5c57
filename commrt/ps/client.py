"""The worker side of the parameter server: ``PSClient``.

Every tensor is cut into segments by ``partition`` (the same on every worker); a call sends one
message per server, all at once, and waits for every reply (ps/exchange.py: pings, resends after
a server restart, PeerLost for a silent server, zero-copy frames released after an error).
"""
from __future__ import annotations

import itertools
import logging
import os
import secrets
from typing import Mapping

import numpy as np
import zmq

from commrt.runtime import arrays
from commrt.runtime.config import Config, load_config
from commrt.runtime.dtypes import as_buffer, code_of
from commrt.runtime.errors import CommError, ConfigError, ProtocolError, RequestRejected
from commrt.transport.transport import Transport
from commrt.transport.memory import keep_freed_memory
from commrt.runtime.work import Executor, Work
from commrt.ps import protocol as P
from commrt.ps.exchange import Exchange
from commrt.ps.membership import starting_step
from commrt.ps.partition import Segment, TensorSpec, partition

log = logging.getLogger(__name__)
Tensors = Mapping[str, "torch.Tensor | np.ndarray"]
ZERO_COPY_MIN = 64 << 10


def _on_host(name: str, t, what: str, writes: bool = True):
    """``t`` as given (a numpy array stays one: a numpy-only worker never loads torch), refused
    unless in host memory: frames are read from it and pulls land in it through numpy (a CUDA
    tensor failed there with a TypeError, a push_pull's only after its step was applied).
    ``writes``: a pull lands in it (a read-only array is refused; one only read is sent)."""
    t = as_buffer(t, writes)
    if not isinstance(t, np.ndarray) and t.device.type != "cpu":
        raise RequestRejected(None, what, f"{name} is on {t.device}: the parameter-server client reads "
                              "and writes host memory (pass CPU tensors, e.g. .cpu() copies)")
    return t


def _itemsize(t) -> int:
    return t.itemsize if isinstance(t, np.ndarray) else t.element_size()


def _flat_bytes(t) -> np.ndarray:
    """``t``'s elements in order as flat bytes: a view of its memory when contiguous, else a copy."""
    if isinstance(t, np.ndarray):
        return np.ascontiguousarray(t).reshape(-1).view(np.uint8)
    return arrays.as_bytes(t.reshape(-1).contiguous())


class PSClient(Exchange):
    """A worker's handle on the servers: init, push, pull (the exchange itself: ps/exchange.py)."""

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
        # this process's incarnation of the worker id: a shard refuses a second live process
        # claiming the id, and lets one replace a predecessor that is gone (ps/incarnations.py)
        self.nonce = 1 + secrets.randbelow((1 << 62) - 1)
        if self.cfg.comm.keep_freed_memory:
            keep_freed_memory()  # large pushes and pulls reuse pages
        self.segments: list[Segment] = []
        self._local: list[list[int]] = []  # per server: global segment index of each local id
        self._init_error: str | None = None
        self._ids = itertools.count(1)
        self._closing = False  # set by close(): a call in flight gives up within a poll slice
        self._exec = Executor(f"ps-worker{worker}")  # its lock owns the sockets
        self.transport = Transport(self.cfg, f"rank{worker}")
        self._socks: list[zmq.Socket] = []
        try:
            self._socks = [self._dial(k) for k in range(len(ps.servers))]
        except BaseException:
            self.close()
            raise
        self._poller = self._new_poller()

    # -- public API -------------------------------------------------------------------------
    def init(self, params: Tensors) -> None:
        """Register the parameters. Worker 0 seeds the servers with its values; the others wait
        until it has, then should ``pull`` them. Restarted workers learn their step here, and a
        worker that joins a running async/SSP job is admitted at the running step (``step``;
        ps/membership.py). If the servers refuse the description, push and pull are refused
        until an init succeeds."""
        self._exec.run("ps.init", lambda: self._init(params), self.cfg.ps.timeout_s * 10)

    def push(self, grads: Tensors) -> None:
        self._exec.run("ps.push", lambda: self._push(grads, None), self.cfg.ps.timeout_s * 10)

    def pull(self, into: Tensors) -> None:
        self._exec.run("ps.pull", lambda: self._pull(into), self.cfg.ps.timeout_s * 10)

    def push_pull(self, grads: Tensors, into: Tensors) -> None:
        """Push ``grads``, then receive the new values of the pushed tensors into ``into``,
        which names all of them or some (the others' values are dropped), never another one."""
        self._exec.run("ps.push_pull", lambda: self._push(grads, into), self.cfg.ps.timeout_s * 10)

    def push_async(self, grads: Tensors) -> Work:
        return self._exec.submit("ps.push", lambda: self._push(grads, None))

    def pull_async(self, into: Tensors) -> Work:
        return self._exec.submit("ps.pull", lambda: self._pull(into))

    def push_pull_async(self, grads: Tensors, into: Tensors) -> Work:
        return self._exec.submit("ps.push_pull", lambda: self._push(grads, into))

    def stats(self) -> list[dict]:
        """Each server's counters (pushes, pulls, bytes, version, staleness histogram, lag)."""
        def ask():
            replies = self._exchange(P.STATS, 0, {k: ([], []) for k in range(len(self._socks))})
            return [replies[k][0].body for k in range(len(self._socks))]
        return self._exec.run("ps.stats", ask, self.cfg.ps.timeout_s * 10)

    def close(self) -> None:
        """Cancel the call in flight (it raises CommError) and queued ones, then close the
        sockets, unless the call did not give them back in time (then they are left to exit)."""
        self._closing = True
        if not self._exec.close(timeout_s=5.0 + 2 * self.cfg.ps.retry_s):  # still owns the sockets
            self.transport.close(leaked_sockets=True)
            return
        for s in self._socks:
            s.close(linger=0)
        self.transport.close()

    # -- requests ---------------------------------------------------------------------------
    def _init(self, params: Tensors) -> None:
        specs, shapes = [], []
        params = {name: _on_host(name, t, "ps.init", writes=False) for name, t in params.items()}
        for name, t in params.items():
            specs.append(TensorSpec(name, arrays.numel(t), _itemsize(t), code_of(t.dtype)))
            shapes.append([name, list(t.shape)])
        segments = partition(specs, len(self._socks), self.cfg.ps.max_segment_bytes,
                             whole_tensors=self.cfg.ps.optimizer == "lamb")
        local = [[i for i, s in enumerate(segments) if s.server == k] for k in range(len(self._socks))]
        seed = self.worker == 0
        flats = {name: _flat_bytes(t) for name, t in params.items()} if seed else {}
        sizes = {s.name: s.itemsize for s in specs}
        reqs = {}
        for k, glob in enumerate(local):
            body = [seed, [[segments[g].name, segments[g].start, segments[g].stop, segments[g].dtype]
                           for g in glob], shapes]
            reqs[k] = (body, [self._frame(flats[segments[g].name], segments[g], sizes[segments[g].name])
                              for g in glob] if seed else [])
        for k, (body, _) in reqs.items():  # the server would drop it unread: say why here
            try:
                P.decode_request(P.encode_request(P.INIT, self.worker, self.step, 0, body, self.nonce))
            except ProtocolError as exc:
                raise RequestRejected(None, "ps.init", f"server {k}'s part of the description is over "
                                      f"the protocol's limits: {exc}") from None
        self.segments, self._init_error = [], None
        try:
            step = self._join(self._exchange(P.INIT, self.step, reqs))
        except CommError as exc:
            self._init_error = f"{type(exc).__name__}: {exc}"
            raise
        self.segments, self._local, self.step = segments, local, step
        self._shapes = {name: tuple(dims) for name, dims in shapes}
        self._dtypes = {s.name: s.dtype for s in specs}
        self._itemsizes = sizes

    def _join(self, replies: dict) -> int:
        """The step this worker starts at, from the init replies [version, clock, member, start]
        (the two rounds of ps/membership.py): a member everywhere resumes at its lowest clock;
        otherwise every server admits it at the highest start any of them named."""
        join, start = starting_step([r.body for r, _ in replies.values()])
        if not join:
            return start
        joined = self._exchange(P.JOIN, start, {k: ([], []) for k in range(len(self._socks))})
        clocks = {k: r.body[1] for k, (r, _) in joined.items()}
        if set(clocks.values()) != {start}:
            raise ProtocolError(f"worker {self.worker}: ps.join at step {start} was admitted at steps {clocks} "
                                "(server: step)")
        log.info("worker %d joins the running job at step %d (version %s)", self.worker, start,
                 [r.body[0] for r, _ in joined.values()])
        return start

    def _selected(self, tensors: Tensors, what: str, writes: bool = True) -> dict[int, list[tuple[int, int]]]:
        """Per server: (local id, global index) of every segment of the named tensors;
        ``writes``: the call lands values in them."""
        if not self.segments:
            why = f" (the last init failed: {self._init_error})" if self._init_error else ""
            raise RequestRejected(None, what, f"call init(params) before push/pull{why}")
        unknown = [n for n in tensors if n not in self._dtypes]
        if unknown:
            raise RequestRejected(None, what, f"unknown parameter(s) {unknown[:5]}; init registered "
                                  f"{list(self._dtypes)[:5]}...")
        for name, t in tensors.items():
            t = _on_host(name, t, what, writes)
            if tuple(t.shape) != self._shapes[name] or code_of(t.dtype) != self._dtypes[name]:
                raise RequestRejected(None, what, f"{name}: expected shape {self._shapes[name]} and dtype "
                                      f"code {self._dtypes[name]}, got shape {tuple(t.shape)} and {t.dtype}")
        return {k: [(lid, g) for lid, g in enumerate(glob) if self.segments[g].name in tensors]
                for k, glob in enumerate(self._local)}

    @staticmethod
    def _frame(flat: np.ndarray, seg: Segment, size: int):
        """The bytes of ``seg`` (elements of ``size`` bytes) in its tensor's flat bytes: large
        ones leave without a copy."""
        view = flat[seg.start * size:seg.stop * size]
        return view if view.nbytes >= ZERO_COPY_MIN else view.tobytes()

    def _push(self, grads: Tensors, into: Tensors | None) -> None:
        op = P.PUSHPULL if into is not None else P.PUSH
        sel = self._selected(grads, f"ps.{P.OP_NAMES[op]}", writes=False)
        if into is not None:
            self._selected(into, f"ps.{P.OP_NAMES[op]}")
            unpushed = [name for name in into if name not in grads]
            if unpushed:  # the pull half returns the pushed segments only
                raise RequestRejected(None, "ps.push_pull", f"into names {unpushed[:5]}, which grads does not "
                                      "push: push_pull pulls what it pushes (pull them separately)")
        flats = {name: _flat_bytes(as_buffer(g, writes=False)) for name, g in grads.items()}
        segs = self.segments
        reqs = {k: ([lid for lid, _ in pairs], [self._frame(flats[segs[g].name], segs[g], self._itemsizes[segs[g].name])
                                                 for _, g in pairs]) for k, pairs in sel.items()}
        # every server hears of every step (if need be with no segments): a worker's step is one
        # clock across all shards, which is what exactly-once and the sync/SSP rules count
        replies = self._exchange(op, self.step, reqs)
        self.step += 1
        if into is not None:
            self._unpack(into, sel, replies)

    def _pull(self, into: Tensors) -> None:
        sel = self._selected(into, "ps.pull")
        reqs = {k: ([lid for lid, _ in pairs], []) for k, pairs in sel.items() if pairs}
        self._unpack(into, sel, self._exchange(P.PULL, self.step, reqs))

    def _unpack(self, into: Tensors, sel: dict, replies: dict) -> None:
        targets = {}  # name -> (the caller's buffer, a flat one the values land in, its bytes)
        for name, t in into.items():
            t = as_buffer(t)
            flat = arrays.flat_plain(t) if arrays.is_contiguous(t) else arrays.empty(arrays.numel(t), t)
            targets[name] = (t, flat, arrays.as_bytes(flat))
        for k, pairs in sel.items():
            if not pairs:
                continue
            reply, frames = replies[k]
            if reply.body[1] != [lid for lid, _ in pairs] or len(frames) != len(pairs):
                raise ProtocolError(f"server {k} answered a pull with other segments than asked")
            for (_, g), frame in zip(pairs, frames):
                seg = self.segments[g]
                if seg.name not in targets:  # pushed, not asked for (push_pull into fewer tensors)
                    continue
                size = self._itemsizes[seg.name]
                dst = targets[seg.name][2][seg.start * size:seg.stop * size]
                if len(frame) != dst.nbytes:
                    raise ProtocolError(f"server {k} sent {len(frame)} bytes for {seg.name}[{seg.start}:{seg.stop}]")
                np.copyto(dst, np.frombuffer(frame.buffer, dtype=np.uint8))
        for t, flat, _ in targets.values():
            if not arrays.is_contiguous(t):
                arrays.assign(t, flat.reshape(t.shape))
