"""Sub-groups (``new_group``), and how a zmq group's members learn each other's addresses.

Each member publishes its group backend's addresses in the bootstrap store under the group's id
(every rank calls new_group in the same order, so ids agree) before new_group returns, and reads
a partner's entry when it first dials it (``Endpoint.connect(resolve=)``, as the world reads
hellos): a member reads O(the partners it talks to), a non-member nothing, and no rank sends
anything over the world for it. Before, every world rank all-gathered a 256-byte row from every
rank (4 MiB per rank per new_group at 16,384 ranks, non-members included; issue 32.5).

A group whose members may share memory reads every member's entry at creation instead: its
channel maps every member at once (zmq_shm.open_channel), so it dials them all anyway."""
from __future__ import annotations

import sys
import threading
import time

import msgpack

from commrt.backends.zmq_backend import ZmqBackend
from commrt.runtime import rendezvous
from commrt.runtime.errors import RendezvousError
from commrt.runtime.group import NON_GROUP_MEMBER, ProcessGroup
from commrt.runtime.store import TorchStore
from commrt.runtime.store_core import OK
from commrt.topology.nodes import Topology

READ_SLICE_S = 0.2
"""A read of an entry not yet published waits in the store this long per request: the store
client's one connection (and its lock) also serves the world's hello reads from other threads,
which a wait for a late member must not hold up for the whole deadline."""


class Tally:
    """Group entries this rank read from the store and their bytes, and entries it published
    (comm_stats()["rendezvous"]). Thread-safe: groups resolve from their endpoints' threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._n = [0, 0, 0]  # read, bytes read, published

    def add(self, read: int = 0, nbytes: int = 0, published: int = 0) -> None:
        with self._lock:
            self._n[0] += read
            self._n[1] += nbytes
            self._n[2] += published

    def stats(self) -> dict:
        with self._lock:
            read, nbytes, published = self._n
        return {"group_addresses_read": read, "group_address_bytes": nbytes,
                "group_addresses_published": published}


def group_key(ns: str, gid: int, rank: int) -> str:
    """Global rank ``rank``'s entry for group ``gid`` (``ns``: the runtime's store namespace)."""
    return f"{ns}group/{gid}/{rank}"


class GroupAddresses:
    """One group's members' addresses: this member's published, the others' read from the store
    when first needed (``get``, keyed by group rank), each once. ``store_rank``: the global rank
    serving the store (None: torchrun's agent)."""

    def __init__(self, store, ns: str, gid: int, members: tuple[int, ...], me: int, timeout_s: float,
                 tally: Tally, store_rank: int | None = 0):
        self.store, self.ns, self.gid, self.members, self.me = store, ns, gid, members, me
        self.timeout_s, self.tally, self.store_rank = timeout_s, tally, store_rank
        self._known: dict[int, list] = {}  # by group rank
        self._lock = threading.Lock()

    def publish(self, addresses: list[str]) -> None:
        self._known[self.members.index(self.me)] = addresses
        self.store.set(group_key(self.ns, self.gid, self.me), msgpack.packb(addresses))
        self.tally.add(published=1)

    def every(self, op: str) -> list[list[str]]:
        """Every member's addresses (waiting for late members within the deadline)."""
        return [a for _, a in sorted(self.get(range(len(self.members)), op).items())]

    def get(self, peers, op: str, lost: int | None = None) -> dict[int, list]:
        """The addresses of group ranks ``peers``, the unknown ones read in one request. ``lost``:
        a group rank known dead; if it serves the store, only known ones come back (a best-effort
        caller must not wait out the deadline on a dead store)."""
        with self._lock:
            missing = [p for p in peers if p not in self._known]
            if missing and (lost is None or self.members[lost] != self.store_rank):
                self._fetch(missing, op)
            return {p: self._known[p] for p in peers if p in self._known}

    def _fetch(self, missing: list[int], op: str) -> None:
        keys = [group_key(self.ns, self.gid, self.members[p]) for p in missing]
        values = read_when_published(self.store, keys, time.monotonic() + self.timeout_s)
        late = [self.members[p] for p, v in zip(missing, values) if v is None]
        got = [v for v in values if v is not None]
        self.tally.add(len(got), sum(len(v) for v in got))
        if late:
            raise RendezvousError(
                f"rank {self.me}: group {self.gid} (ranks {rendezvous.rank_ranges(list(self.members))}): "
                f"rank {rendezvous.rank_ranges(late)} published no address within {self.timeout_s:g}s "
                f"for {op} (did every rank call new_group, in the same order?)")
        for p, v in zip(missing, values):
            self._known[p] = msgpack.unpackb(v)


def read_when_published(store, keys: list[str], deadline: float) -> list:
    """The values of ``keys``, each waited for until ``deadline`` (None where it never came), in
    requests of at most READ_SLICE_S parked in the store (answered as soon as all exist)."""
    values: list = [None] * len(keys)
    while True:
        todo = [i for i, v in enumerate(values) if v is None]
        left = deadline - time.monotonic()
        if not todo or left <= 0:
            return values
        status, got = store.wait([keys[i] for i in todo], None, min(left, READ_SLICE_S))
        if status == OK:
            for i, v in zip(todo, got):
                values[i] = v
        elif left <= READ_SLICE_S:  # the last slice timed out: one read of what did arrive
            for i, v in zip(todo, store.mget([keys[i] for i in todo])):
                values[i] = v
            return values


def every_address_at_creation(hellos: rendezvous.Hellos | None, layout: Topology | None,
                              members: tuple[int, ...]) -> bool:
    """Whether the members read every member's addresses when they create the group: only where
    they may share memory (a shared-memory channel maps every member at once). Decided from what
    every member knows alike, so all decide the same: the members' world hellos (every rank holds
    every hello, or, where hellos are read per peer, those of its node: shared memory never spans
    nodes, see transport/segments.node_key), which a member holds without reading any. A world
    without hellos (the zmq fallback of a failed NCCL init) reads them all, as many as members."""
    if len(members) < 2:
        return False
    if hellos is None:
        return True
    if hellos.lazy and (layout is None or len({layout.node_rank(r) for r in members}) > 1):
        return False
    known = hellos.get(list(members), "new_group (do the members share memory?)")
    return ZmqBackend.needs_every_address([known[r]["addr"] for r in members])


def connect_group(backend: ZmqBackend, book: GroupAddresses, all_at_once: bool) -> None:
    """Publish this member's addresses, then connect the group's backend: with every member's now
    (``all_at_once``), or each partner's read when first dialled. Publishing comes first, and
    before new_group returns, so a partner that needs it (even in its first collective) finds it
    or waits in the store for it within the deadline."""
    if len(book.members) > 1:
        book.publish(backend.addresses)
    if all_at_once:
        backend.connect(book.every("new_group"))
    else:
        backend.connect_lazy(book.get)


def new_group(rt, ranks: list[int]):
    """Every world rank calls this in the same order (as with torch); members get a group.
    ``rt``: the bootstrap's Runtime."""
    world = rt.world
    members = tuple(sorted(set(ranks)))
    if not members or members[0] < 0 or members[-1] >= world.size():
        raise ValueError(f"new_group: ranks {ranks} must be a non-empty subset of 0..{world.size() - 1}")
    gid = rt.next_group_id
    rt.next_group_id += 1
    me = world.rank
    if is_torch_backend(world.backend):
        import torch  # lazy, as in bootstrap: a zmq world never loads torch
        from commrt.runtime import torch_init
        from commrt.integrations.torch_backend import TorchBackend
        with torch_init.gloo_interface(rt.config):
            pg = torch.distributed.new_group(list(members))
        if me not in members:
            return NON_GROUP_MEMBER
        backend = TorchBackend(world.backend.name, pg, list(members), members.index(me))
    else:
        backend = _new_zmq_group(rt, members, gid)
        if backend is None:
            return NON_GROUP_MEMBER
    group = ProcessGroup(members, members.index(me), backend, gid)
    rt.groups.append(group)
    return group


def _new_zmq_group(rt, members: tuple[int, ...], gid: int) -> ZmqBackend | None:
    """This member's backend of group ``gid``, connected through the store, or None on a
    non-member, which neither reads nor sends anything."""
    me = rt.world.rank
    rt.store_groups += int(len(members) > 1)  # alike on every rank: see bootstrap.shutdown
    if me not in members:
        return None
    all_at_once = every_address_at_creation(rt.hellos, rt.topology, members)
    backend = ZmqBackend(rt.transport, rt.config, members.index(me), len(members), gid, list(members))
    book = GroupAddresses(rt.store, rt.namespace, gid, members, me, rt.config.comm.timeout_s,
                          rt.group_reads, store_rank(rt))
    try:
        connect_group(backend, book, all_at_once)
    except BaseException:
        backend.close()
        raise
    return backend


def store_rank(rt) -> int | None:
    """The world rank serving ``rt``'s store: 0, or None where torchrun's agent serves it."""
    if rt.hellos is not None:
        return rt.hellos.store_rank
    return None if isinstance(rt.store, TorchStore) else 0


def is_torch_backend(backend) -> bool:
    """A gloo/nccl world (integrations/torch_backend.py): one exists only once that module is loaded."""
    mod = sys.modules.get("commrt.integrations.torch_backend")
    return mod is not None and isinstance(backend, mod.TorchBackend)
