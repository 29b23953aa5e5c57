"""The bootstrap store's logic, without sockets (served by ``store.StoreServer``).

``StoreCore`` validates every request (types, lengths, int64 counters) and parks waits, answering
them when their keys appear, their abort key is set or their deadline passes, so ranks never
poll. It is bounded by bytes (``MAX_BYTES``), not by entry counts. Every request but ``hello``
carries the store's incarnation token, so a client of an earlier store cannot use this one.
"""
from __future__ import annotations

import heapq
import itertools
import os
from dataclasses import dataclass, field
from typing import Any

from commrt.runtime.errors import ProtocolError

MAX_KEY = 256
MAX_VALUE = 1 << 20
MAX_BYTES = 1 << 30  # everything stored (keys, values, overhead): a bootstrap store, not a database
MAX_FRAME = 64 << 20  # one request or reply (an mget of 100,000 hellos fits)
MAX_REPLY = MAX_FRAME - (4 << 10)  # the values one reply may carry (room left for the envelope)
MAX_WAIT_S = 1e6
INT64 = (-(1 << 63), (1 << 63) - 1)
ENTRY_OVERHEAD = 64
OK, ABORT, TIMEOUT = "ok", "abort", "timeout"


def _key(k: Any, what: str = "key") -> str:
    if not isinstance(k, str) or not 0 < len(k) <= MAX_KEY:
        raise ProtocolError(f"{what} must be a non-empty string of at most {MAX_KEY} characters, got {k!r:.80}")
    return k


def _int64(v: Any, what: str) -> int:
    if type(v) is not int or not INT64[0] <= v <= INT64[1]:
        raise ProtocolError(f"{what} must be an integer within int64, got {v!r:.40}")
    return v


def _seconds(v: Any) -> float:
    if type(v) not in (int, float) or not 0 <= v <= MAX_WAIT_S:  # NaN fails the comparison
        raise ProtocolError(f"timeout must be a number of seconds in [0, {MAX_WAIT_S:g}], got {v!r:.40}")
    return float(v)


def _fits(values: list, method: str) -> list:
    """``values`` if a reply can carry them, else ProtocolError: a key may be asked for any
    number of times, so a small request could make the store build a reply of gigabytes."""
    size = sum(len(v) + 5 for v in values if isinstance(v, bytes)) + 9 * len(values)  # msgpack's headers, ints
    if size > MAX_REPLY:
        raise ProtocolError(f"{method}: a reply of {size} bytes exceeds the frame limit of {MAX_FRAME} "
                            f"({len(values)} keys asked for): ask for less at once")
    return values


def _args(body: Any, n: int, method: str) -> list:
    if not isinstance(body, list) or len(body) != n:
        raise ProtocolError(f"{method} takes {n} arguments, got {body!r:.80}")
    return body


@dataclass(eq=False)
class _Wait:
    """A parked wait: for every key in ``keys`` (``next`` is the first not yet seen to exist),
    or for counter ``keys[0]`` to reach ``target``; ``added``: the counter's value right after
    the request's own add (``add_wait_count``), sent back with the answer."""
    token: Any  # whatever the server needs to answer (an rpc Call)
    keys: list
    abort_key: str | None
    deadline: float
    target: int | None = None
    next: int = 0
    done: bool = field(default=False)
    added: int | None = None


def _prune(entries: list, wait_of=lambda entry: entry) -> bool:
    """Drop the answered waits from a key's index when it doubles past 64 entries (amortised
    O(1)): a timed-out wait stays indexed until its key arrives, so a client re-waiting in short
    slices for a key that never comes (groups.read_when_published, every 0.2 s, for a rank that
    died) grew rank 0's store without bound. True when it dropped some."""
    n = len(entries)
    if n < 64 or n & (n - 1):
        return False
    entries[:] = [e for e in entries if not wait_of(e).done]
    return len(entries) < n


class StoreCore:
    """The store's state and request logic. ``handle`` returns a reply, or None when it parked
    the request; parked ones come back from ``handle``'s and ``expire``'s ``answered`` lists as
    (token, reply) pairs, a reply being a ProtocolError where the wait is refused after all."""

    def __init__(self, incarnation: int | None = None):
        self.incarnation = incarnation if incarnation is not None else int.from_bytes(os.urandom(7), "little")
        self.data: dict[str, bytes | int] = {}
        self.nbytes = 0
        self._by_key: dict[str, list[_Wait]] = {}  # waits whose next missing key is this one
        self._by_counter: dict[str, list] = {}  # counter -> heap of (target, seq, wait)
        self._by_abort: dict[str, set[_Wait]] = {}
        self._deadlines: list = []  # heap of (deadline, seq, wait)
        self._seq = itertools.count()
        self.answered: list[tuple[Any, list]] = []

    # -- requests -------------------------------------------------------------------------
    def handle(self, method: str, body: Any, token: Any, now: float) -> list | None:
        if method == "hello":
            return [OK, self.incarnation]
        if not isinstance(body, list) or not body or body[0] != self.incarnation:
            got = body[0] if isinstance(body, list) and body else None
            raise ProtocolError(f"request for store incarnation {got!r:.24}, this is {self.incarnation} "
                                "(a client of an earlier init_process_group)")
        args = body[1:]
        if method == "set":
            key, value = _args(args, 2, method)
            if not isinstance(value, bytes) or len(value) > MAX_VALUE:
                raise ProtocolError(f"set: the value must be bytes of at most {MAX_VALUE}")
            self._put(_key(key), value)
            return [OK]
        if method == "mget":
            (keys,) = _args(args, 1, method)
            if not isinstance(keys, list):
                raise ProtocolError("mget takes a list of keys")
            return [OK, _fits([self.data.get(_key(k)) for k in keys], method)]
        if method == "add":
            key, amount = _args(args, 2, method)
            return [OK, self._add(_key(key), _int64(amount, "add amount"))]
        if method == "wait":
            keys, abort_key, timeout = _args(args, 3, method)
            if not isinstance(keys, list):
                raise ProtocolError("wait takes a list of keys")
            w = _Wait(token, [_key(k) for k in keys], self._abort(abort_key), now + _seconds(timeout))
            return self._park(w, now)
        if method == "wait_count":
            key, target, abort_key, timeout = _args(args, 4, method)
            w = _Wait(token, [_key(key)], self._abort(abort_key), now + _seconds(timeout),
                      target=_int64(target, "wait_count target"))
            return self._park(w, now)
        if method == "add_wait_count":
            key, amount, target, abort_key, timeout = _args(args, 5, method)
            w = _Wait(token, [_key(key)], self._abort(abort_key), now + _seconds(timeout),
                      target=_int64(target, "add_wait_count target"))
            w.added = self._add(w.keys[0], _int64(amount, "add amount"))  # no parked wait is ours yet
            return self._park(w, now)
        raise ProtocolError(f"unknown store method {method!r:.40}; valid: hello, set, mget, add, wait, wait_count, "
                            "add_wait_count")

    @staticmethod
    def _abort(k: Any) -> str | None:
        return None if k is None else _key(k, "abort key")

    def _put(self, key: str, value: bytes | int) -> None:
        old = self.data.get(key)
        size = lambda v: 8 if isinstance(v, int) else len(v)  # noqa: E731
        grow = size(value) - (size(old) if old is not None else -len(key) - ENTRY_OVERHEAD)
        if self.nbytes + grow > MAX_BYTES:
            raise ProtocolError(f"store is full ({MAX_BYTES} bytes)")
        self.nbytes += grow
        self.data[key] = value
        if old is None:
            self._arrived(key)
        if isinstance(value, int):
            self._counted(key, value)

    def _add(self, key: str, amount: int) -> int:
        old = self.data.get(key, 0)
        if not isinstance(old, int):
            raise ProtocolError(f"add: key {key!r} holds bytes, not a counter")
        value = _int64(old + amount, f"counter {key!r} after adding {amount}")
        self._put(key, value)
        return value

    # -- parked waits -----------------------------------------------------------------------
    def _park(self, w: _Wait, now: float) -> list | None:
        if w.abort_key is not None and w.abort_key in self.data:
            return self._with_added(w, [ABORT, self.data[w.abort_key]])
        if self._advance(w):
            return self._done_reply(w)
        if w.deadline <= now:
            w.done = True  # it may sit in a key's index: make that entry inert
            return self._timeout_reply(w)
        if w.abort_key is not None:
            self._by_abort.setdefault(w.abort_key, set()).add(w)
        if w.target is not None:
            heap = self._by_counter.setdefault(w.keys[0], [])
            heapq.heappush(heap, (w.target, next(self._seq), w))
            if _prune(heap, lambda entry: entry[2]):
                heapq.heapify(heap)
        heapq.heappush(self._deadlines, (w.deadline, next(self._seq), w))
        return None

    def _advance(self, w: _Wait) -> bool:
        """True when ``w`` is satisfied; else it is indexed under its next missing key."""
        if w.target is not None:
            v = self.data.get(w.keys[0], 0)
            return isinstance(v, int) and v >= w.target
        while w.next < len(w.keys) and w.keys[w.next] in self.data:
            w.next += 1
        if w.next == len(w.keys):
            return True
        waits = self._by_key.setdefault(w.keys[w.next], [])
        waits.append(w)
        _prune(waits)
        return False

    @staticmethod
    def _with_added(w: _Wait, reply: list) -> list:
        return reply if w.added is None else [*reply, w.added]

    def _done_reply(self, w: _Wait) -> list:
        if w.target is not None:
            return self._with_added(w, [OK, self.data.get(w.keys[0], 0)])
        return [OK, _fits([self.data[k] for k in w.keys], "wait")]

    def _timeout_reply(self, w: _Wait) -> list:
        if w.target is not None:
            return self._with_added(w, [TIMEOUT, self.data.get(w.keys[0], 0)])
        return [TIMEOUT, [k for k in w.keys if k not in self.data]]

    def _finish(self, w: _Wait, reply: list) -> None:
        w.done = True
        if w.abort_key is not None:
            self._by_abort.get(w.abort_key, set()).discard(w)
        self.answered.append((w.token, reply))

    def _arrived(self, key: str) -> None:
        for w in self._by_key.pop(key, []):
            if not w.done and self._advance(w):
                try:
                    reply = self._done_reply(w)
                except ProtocolError as exc:  # the waiter's error; the request that set the key stands
                    reply = exc
                self._finish(w, reply)
        for w in list(self._by_abort.pop(key, ())):
            if not w.done:
                self._finish(w, self._with_added(w, [ABORT, self.data[key]]))

    def _counted(self, key: str, value: int) -> None:
        heap = self._by_counter.get(key)
        while heap and heap[0][0] <= value:
            w = heapq.heappop(heap)[2]
            if not w.done:
                self._finish(w, self._with_added(w, [OK, value]))

    def expire(self, now: float) -> None:
        """Answer every parked wait whose deadline has passed (with what is still missing)."""
        while self._deadlines and self._deadlines[0][0] <= now:
            w = heapq.heappop(self._deadlines)[2]
            if not w.done:
                self._finish(w, self._timeout_reply(w))

    def take_answered(self) -> list[tuple[Any, list]]:
        out, self.answered = self.answered, []
        return out
