"""On-disk formats for a server shard: a checkpoint and a write-ahead log. No pickle: msgpack
metadata with limits, then raw little-endian arrays.

checkpoint:  b"CMRTCKP1" | u64 meta length | msgpack meta | arrays back to back
log record:  b"WAL1" | u32 meta length | u64 payload length | u32 crc32 | meta | payload

A checkpoint is written to a temporary file, fsynced and renamed over the old one, so a crash
leaves either the old or the new file. Log records carry a checksum: a torn record at the end
(the process died mid-write) is ignored on replay, everything before it is kept.
"""
from __future__ import annotations

import contextlib
import os
import struct
import zlib
from typing import Iterator

import msgpack
import numpy as np

from commrt.runtime.dtypes import NAMES, NUMPY
from commrt.runtime.errors import ProtocolError

CKPT_MAGIC = b"CMRTCKP1"
WAL_MAGIC = b"WAL1"
_WAL_HEAD = struct.Struct("<4sIQI")
MAX_META = 64 << 20
NUMPY_DTYPES = {code: NUMPY[name] for code, name in NAMES.items() if name != "bfloat16"}
NUMPY_DTYPES[4] = np.dtype(np.uint16)  # bfloat16 travels as its raw 16-bit pattern


def _describe(arrays: list[np.ndarray], codes: list[int]) -> list[list[int]]:
    return [[code, a.size] for a, code in zip(arrays, codes)]


def _read_arrays(buf: memoryview, layout: list, what: str) -> list[np.ndarray]:
    out, offset = [], 0
    for item in layout:
        if not (isinstance(item, list) and len(item) == 2 and item[0] in NUMPY_DTYPES
                and type(item[1]) is int and item[1] >= 0):
            raise ProtocolError(f"{what}: bad array description {item!r}")
        dt = NUMPY_DTYPES[item[0]]
        n = item[1] * dt.itemsize
        if offset + n > len(buf):
            raise ProtocolError(f"{what}: truncated (needs {offset + n} bytes, has {len(buf)})")
        out.append(np.frombuffer(buf[offset:offset + n], dtype=dt).copy())
        offset += n
    if offset != len(buf):
        raise ProtocolError(f"{what}: {len(buf) - offset} unexpected trailing bytes")
    return out


def _unpack_meta(raw: bytes, what: str) -> dict:
    try:
        meta = msgpack.unpackb(raw, raw=False, max_bin_len=0, max_ext_len=0, strict_map_key=True)
    except Exception as exc:
        raise ProtocolError(f"{what}: undecodable metadata: {exc}") from None
    if not isinstance(meta, dict):
        raise ProtocolError(f"{what}: metadata must be a map")
    return meta


def save_checkpoint(path: str, meta: dict, arrays: list[np.ndarray], codes: list[int]) -> None:
    meta = dict(meta, arrays=_describe(arrays, codes))
    head = msgpack.packb(meta, use_bin_type=True)
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "wb") as fh:
            fh.write(CKPT_MAGIC + struct.pack("<Q", len(head)) + head)
            for a in arrays:
                fh.write(np.ascontiguousarray(a).view(np.uint8).data)
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)  # a full disk gets its space back; the old checkpoint stays whole
        raise
    os.replace(tmp, path)
    fsync_dir(path)


def fsync_dir(path: str) -> None:
    """Make ``path``'s directory entry durable (a new or renamed file survives a machine crash)."""
    dir_fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load_checkpoint(path: str) -> tuple[dict, list[np.ndarray]]:
    with open(path, "rb") as fh:
        data = memoryview(fh.read())
    if bytes(data[:8]) != CKPT_MAGIC or len(data) < 16:
        raise ProtocolError(f"{path} is not a commrt checkpoint")
    (n,) = struct.unpack("<Q", data[8:16])
    if n > MAX_META or 16 + n > len(data):
        raise ProtocolError(f"{path}: metadata length {n} is out of bounds")
    meta = _unpack_meta(bytes(data[16:16 + n]), path)
    return meta, _read_arrays(data[16 + n:], meta.get("arrays", []), path)


class WriteAheadLog:
    """Append-only log of updates applied since the last checkpoint. ``size``: its bytes, which
    the server bounds by checkpointing early (each update record holds whole gradients)."""

    def __init__(self, path: str, fsync: bool):
        self.path, self._fsync = path, fsync
        new = not os.path.exists(path)
        self._fh = open(path, "ab")
        self.size = self._fh.tell()
        if fsync and new:  # fsync of the file alone leaves a new file's name to a crash
            fsync_dir(path)

    def append(self, meta: dict, arrays: list[np.ndarray], codes: list[int]) -> None:
        head = msgpack.packb(dict(meta, arrays=_describe(arrays, codes)), use_bin_type=True)
        payload = [np.ascontiguousarray(a).view(np.uint8).data for a in arrays]
        size = sum(len(p) for p in payload)
        crc = zlib.crc32(head)
        for p in payload:
            crc = zlib.crc32(p, crc)
        self._fh.write(_WAL_HEAD.pack(WAL_MAGIC, len(head), size, crc) + head)
        for p in payload:
            self._fh.write(p)
        self._fh.flush()
        self.size += _WAL_HEAD.size + len(head) + size
        if self._fsync:
            os.fsync(self._fh.fileno())

    def truncate(self) -> None:
        self._fh.close()
        self._fh = open(self.path, "wb")
        self.size = 0

    def close(self) -> None:
        self._fh.close()


def read_log(path: str) -> Iterator[tuple[dict, list[np.ndarray]]]:
    """Every intact record in order; stops quietly at a torn or corrupt tail."""
    if not os.path.exists(path):
        return
    with open(path, "rb") as fh:
        data = memoryview(fh.read())
    pos = 0
    while pos + _WAL_HEAD.size <= len(data):
        magic, n, size, crc = _WAL_HEAD.unpack(data[pos:pos + _WAL_HEAD.size])
        body = pos + _WAL_HEAD.size
        if magic != WAL_MAGIC or n > MAX_META or body + n + size > len(data):
            return
        head, payload = data[body:body + n], data[body + n:body + n + size]
        if zlib.crc32(payload, zlib.crc32(head)) != crc:
            return
        meta = _unpack_meta(bytes(head), path)
        yield meta, _read_arrays(payload, meta.get("arrays", []), path)
        pos = body + n + size
