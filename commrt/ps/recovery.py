"""A server shard's durability: checkpoint, write-ahead log, resume (formats in ``durable``).

A checkpoint is taken every ``checkpoint_every`` updates, and earlier once the log outgrows
``max_log_bytes`` (it holds whole gradients, so at the default interval it would otherwise grow
to ~100 shards). A write that fails (a full disk) becomes ``StorageFailed`` naming the write and
the cause; the shard then stops (``ServerCore._fail``).
"""
from __future__ import annotations

import contextlib
import logging
import os

import numpy as np

from commrt.runtime.config import PsConfig
from commrt.runtime.errors import CommError, ConfigError
from commrt.ps.durable import WriteAheadLog, read_log
from commrt.ps.state import ShardState

log = logging.getLogger(__name__)


class StorageFailed(CommError):
    """A checkpoint or log write failed (e.g. no space left on device): the shard cannot go on
    without breaking its promise that acknowledged updates survive a crash."""


def _failed(what: str, exc: OSError) -> StorageFailed:
    return StorageFailed(f"{what} failed: {exc.strerror or exc}" + (f" ({exc.filename})" if exc.filename else ""))


class Durability:
    """Mixed into ``ServerCore``: the parts that touch the disk."""

    state: ShardState
    cfg: PsConfig
    index: int

    def __init__(self, cfg: PsConfig, index: int):
        self.wal: WriteAheadLog | None = None
        self.ckpt_path = self.wal_path = ""
        if cfg.checkpoint_dir:
            try:
                os.makedirs(cfg.checkpoint_dir, exist_ok=True)
            except OSError as exc:
                raise ConfigError(f"server {index}: [ps] checkpoint_dir '{cfg.checkpoint_dir}' cannot be "
                                  f"created: {exc.strerror or exc}") from None
            self.ckpt_path = os.path.join(cfg.checkpoint_dir, f"server-{index}.ckpt")
            self.wal_path = os.path.join(cfg.checkpoint_dir, f"server-{index}.wal")

    def has_checkpoint(self) -> bool:
        return bool(self.ckpt_path) and os.path.exists(self.ckpt_path)

    def never_committed(self) -> bool:
        """Nothing of this shard was ever committed: no checkpoint and no logged update. A kill
        during the very first checkpoint leaves only its temporary file (the rename is atomic)."""
        return bool(self.ckpt_path) and not self.has_checkpoint() and not (
            os.path.exists(self.wal_path) and os.path.getsize(self.wal_path))

    def start_fresh(self) -> None:
        """``--resume`` where nothing was committed: clear the leftovers of the first checkpoint."""
        for leftover in (f"{self.ckpt_path}.tmp", self.wal_path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(leftover)

    def resume(self) -> int:
        """Load the checkpoint and replay the log after it; returns how many updates replayed."""
        self.state.load(self.ckpt_path)
        replayed = 0
        for meta, arrays in read_log(self.wal_path):
            kind = meta.get("k")
            if kind == "d":
                self.state.dropped.update(meta["w"])
            elif kind == "a":  # a late or dropped worker admitted at a step (ps/membership.py)
                self.state.admit(meta["w"], meta["c"])
            elif kind == "j":
                (self.state.joined.add if meta["on"] else self.state.joined.discard)(meta["w"])
            elif kind == "u" and meta["v"] > self.state.version:
                self.state.apply(meta["ids"], arrays)
                self.state.record([tuple(c) for c in meta["c"]], meta.get("g"))
                replayed += 1
        self.checkpoint()
        return replayed

    def checkpoint(self) -> None:
        if not self.ckpt_path or not self.state.initialized:
            return
        try:
            self.state.save(self.ckpt_path)
            if self.wal is None:
                self.wal = WriteAheadLog(self.wal_path, self.cfg.fsync)
            self.wal.truncate()
        except OSError as exc:
            raise _failed("checkpoint write", exc) from exc

    def close(self) -> None:
        """Close the log (the shard stops; a later resume reopens it). Every record was flushed
        when written, so closing can only fail on what a failed write left buffered: that
        failure was already reported (and the record never acknowledged), so it is only logged."""
        if self.wal is not None:
            wal, self.wal = self.wal, None
            try:
                wal.close()
            except OSError as exc:
                log.warning("server %d: closing the log: %s", self.index, exc.strerror or exc)

    def checkpoint_if_due(self) -> None:
        if not self.ckpt_path:
            return
        if (self.state.version % self.cfg.checkpoint_every == 0
                or (self.wal is not None and self.wal.size > self.cfg.max_log_bytes)):
            self.checkpoint()

    def _log(self, meta: dict, arrays: list[np.ndarray]) -> None:
        if self.wal is None:
            return
        try:
            self.wal.append(meta, arrays,
                            [self.state.segs[i].dtype for i in meta.get("ids", [])])
        except OSError as exc:
            raise _failed("log write", exc) from exc
