"""The one place ops are observed: ``distributed`` calls ``begin`` before handing an op to its
backend and ``issued``/``failed`` after; an async op's completion arrives through
``Work._finish`` (``Record.done``), so an op is seen on every backend alike (zmq, gloo, nccl).

The flight recorder is always on (one small record per op). The comms log and the trace cost
nothing unless configured: ``completed`` checks one attribute each.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import threading
import time

from commrt.runtime.config import Config
from commrt.runtime.errors import CollectiveMismatch, OpRefused, PeerLost
from commrt.runtime.work import CommTimeout, Work
from commrt.obs import comms, flight, trace

log = logging.getLogger("commrt.obs")
DUMP_ON = (PeerLost, CollectiveMismatch, OpRefused, CommTimeout)
MAX_TRACE_EVENTS = 1 << 21  # ~0.5 GiB of JSON at most; later events are counted, not kept


class Observer:
    def __init__(self, cfg: Config, rank: int, world_size: int, job: int | None = None):
        """``job``: this run's mark in the flight records (flight.snapshot)."""
        c = cfg.log
        self.rank, self.world_size, self.entries, self.flight_dir = rank, world_size, c.flight_entries, c.flight_dir
        self.job = job
        self.comms = comms.CommsLog() if c.comms else None
        self.verbose = c.comms and c.verbose
        self.trace_path = trace.rank_path(c.trace_file, rank) if c.trace_file else ""
        self.events: list[dict] | None = [] if c.trace_file else None
        self.dropped = 0
        self.rings: dict[int, flight.GroupRing] = {}
        self.wall0 = time.time() - time.perf_counter()  # perf_counter -> wall clock
        self._closed = False
        self._closing = self._term_pending = False  # close() writing; a SIGTERM came meanwhile
        self._pid = os.getpid()  # the rank's; a forked child inherits this object (see _on_term)
        self._spans = False  # a training engine's step spans were traced
        self._last_dump: tuple[str, float] = ("", 0.0)
        self._old_handlers = self._install_handlers()
        if c.comms and not log.hasHandlers() and log.level == logging.NOTSET:
            # the user asked for the log: show it even when the program set up no logging
            log.addHandler(logging.StreamHandler())
            log.setLevel(logging.INFO)
            log.propagate = False  # a program that sets up logging later must not print every line twice
        atexit.register(self.close)

    def _install_handlers(self) -> dict:
        """SIGUSR1 dumps; with a flight_dir or a trace_file, SIGTERM writes them before it ends
        the process (only where the program has no handler of its own, and only from the main
        thread, where Python runs them). The previous handlers, to give back at close."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        wanted = {signal.SIGUSR1: self._on_signal}
        if self.flight_dir or self.trace_path:
            wanted[signal.SIGTERM] = self._on_term
        return {sig: (signal.signal(sig, handler), handler) for sig, handler in wanted.items()
                if signal.getsignal(sig) in (signal.SIG_DFL, None)}

    # -- per op ------------------------------------------------------------------------------
    def begin(self, g, op: str, nbytes: int, dtype, peer: int = -1, async_op: bool = False,
              p2p: bool = False) -> flight.Record:
        ring = self.rings.get(g.group_id)
        if ring is None:
            ring = self.rings[g.group_id] = flight.GroupRing(self, g.group_id, g.ranks, g.rank,
                                                              g.backend.name, self.entries)
        # a sync op starts here, and again when it gets its group's turn inside the call
        # (Record.turn: async ops queued before it may run first); async and point-to-point ops
        # wait in a queue until their owner thread starts them
        state = flight.QUEUED if async_op or p2p else flight.STARTED
        return ring.add(p2p, op, nbytes, dtype, peer, state)

    @staticmethod
    def issued(rec: flight.Record, work: Work | None) -> Work | None:
        if work is None:
            rec.end(None)
        else:
            work._flight = rec
            if work._done.is_set():  # finished before it was registered (done() runs once)
                rec.done(work._error, work._ended_at)
        return work

    def completed(self, rec: flight.Record, error: BaseException | None) -> None:
        if self.comms is not None and error is None:
            begun = rec.started or rec.issued
            ring = rec.ring
            self.comms.add(rec.op, rec.nbytes, ring.gid, ring.backend, len(ring.ranks), rec.ended - begun)
            if self.verbose:
                log.info("%s", json.dumps({"rank": self.rank, "group": ring.gid, **rec.as_dict(self.wall0)}))
        if self.events is not None:
            self._trace(rec)
        if error is not None and isinstance(error, DUMP_ON):
            self.dump(f"{type(error).__name__}: {error}")

    def _trace(self, rec: flight.Record) -> None:
        if len(self.events) >= MAX_TRACE_EVENTS:
            self.dropped += 1
            return
        begun = rec.started or rec.issued
        args = {"seq": rec.seq, "bytes": rec.nbytes, "dtype": str(rec.dtype).replace("torch.", ""),
                "state": rec.state, "queued_us": round((begun - rec.issued) * 1e6, 1)}
        if rec.peer >= 0:
            args["peer"] = rec.peer
        self.events.append(trace.complete_event(rec.op, self.rank, rec.ring.gid, (begun + self.wall0) * 1e6,
                                                (rec.ended - begun) * 1e6, args))

    def span(self, name: str, start: float, seconds: float) -> None:
        """A training engine's step span (train/breakdown.py: forward, backward, optimizer,
        comm_waited, bookkeeping; ``start`` on perf_counter) on the rank's "train step" track."""
        if self.events is None:
            return
        if len(self.events) >= MAX_TRACE_EVENTS:
            self.dropped += 1
            return
        event = trace.complete_event(name, self.rank, trace.TRAIN_TID, (start + self.wall0) * 1e6, seconds * 1e6, {})
        event["cat"] = "train"
        self.events.append(event)
        self._spans = True

    # -- dumps, the summary, the end -----------------------------------------------------------
    def dump(self, reason: str) -> str | None:
        now = time.monotonic()
        if self._last_dump[0] == reason and now - self._last_dump[1] < 1.0:
            return None  # the same error again (a polling wait, every async op of a broken group)
        self._last_dump = (reason, now)
        data = flight.snapshot(self.rank, self.world_size, reason, list(self.rings.values()), self.wall0,
                               self.job)
        if not self.flight_dir:
            log.warning("%s; no flight record written (set [log] flight_dir to keep one)", reason)
            return None
        try:
            path = flight.write_dump(self.flight_dir, data)
        except OSError as exc:
            log.error("cannot write the flight record to %s: %s", self.flight_dir, exc)
            return None
        log.warning("%s; flight record written to %s", reason, path)
        return path

    def _on_signal(self, signum, frame) -> None:
        if os.getpid() == self._pid:  # a forked child writes nothing (see _on_term)
            self.dump("SIGUSR1")

    def _on_term(self, signum, frame) -> None:
        """Stopped from outside: ``commrt launch`` stops every rank within milliseconds of one
        failing, long before the survivors' heartbeats (3 intervals) would raise PeerLost, so
        without this a dead rank's job left no flight record at all (nor the survivors' traces).
        Write them, then end as SIGTERM would have. A forked child of the rank (a DataLoader
        worker) inherits this handler, and commrt launch signals the rank's whole process group:
        it only ends, its records being a stale copy that it wrote over the rank's own."""
        if os.getpid() != self._pid:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self.flight_dir:
            self.dump("SIGTERM (stopped from outside, e.g. by commrt launch after another rank failed)")
        if self._closing:  # it interrupted close() writing the trace: close() ends the process after
            self._term_pending = True
            return
        self.close()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    def summary(self) -> list[dict]:
        return self.comms.rows() if self.comms is not None else []

    def close(self) -> None:
        """Once, at destroy_process_group or at exit: write the trace, log the table (rank 0).
        Not in a forked child (one that exits through atexit): its events are a stale copy."""
        if self._closed or os.getpid() != self._pid:
            return
        self._closed = self._closing = True
        atexit.unregister(self.close)
        try:
            self._write_out()
        finally:
            # the handlers go back only now: SIGTERM while the trace was written (seconds, for
            # a big one) ended the process at once, leaving no trace and its temporary file
            self._closing = False
            if threading.current_thread() is threading.main_thread():
                for sig, (old, mine) in self._old_handlers.items():
                    if signal.getsignal(sig) == mine:  # a handler the program set since is left alone
                        signal.signal(sig, old)
            if self._term_pending:  # ends as that SIGTERM would have (via _on_term off the main thread)
                os.kill(os.getpid(), signal.SIGTERM)

    def _write_out(self) -> None:
        if self.events is not None:
            groups = {gid: f"group {gid} {list(r.ranks)} ({r.backend})" for gid, r in self.rings.items()}
            if self._spans:
                groups[trace.TRAIN_TID] = "train step (forward, backward, optimizer, comm_waited, bookkeeping)"
            events, groups = trace.nest(self.events, groups)
            try:
                trace.write(self.trace_path, trace.track_names(self.rank, groups) + events)
            except OSError as exc:
                log.error("cannot write the trace to %s: %s", self.trace_path, exc)
            if self.dropped:
                log.warning("trace kept the first %d events; %d later ones were dropped",
                            len(self.events), self.dropped)
        if self.comms is not None and self.rank == 0 and self.comms.table:
            log.info("comms summary (rank 0):\n%s", comms.format_table(self.summary()))
