"""Replica fault tolerance with replica *groups* (HYBRID_SHARD's layout, issue 33 item 2): a
replica is a group of ``shards`` ranks (a node) that shard the gradient and the optimizer state
among themselves; the unit that fails, is dropped and rejoins is the whole group.

Per step, inside a group: the local gradients are reduce-scattered (summed) so that rank ``s``
holds shard ``s`` of the group's gradient; across groups, ``ReplicaFT`` all-reduces that shard
among rank ``s`` of every live group (one cross-replica world per shard index, re-formed per
generation), votes, and only then divides by (contributing groups x shards), steps the shard's
optimizer (a torch optimizer over one flat fp32 tensor: this rank's slice of the parameters)
and all-gathers the updated slices inside the group into the model's parameters.

The group's own world is opened once and never re-formed: a group that loses a rank cannot go on
(its shard and optimizer state are gone), so an intra-group failure ends the rank with
``GroupBroken`` and the group is started again as a whole, as a node is.
"""
from __future__ import annotations

import os

import torch

from commrt.collectives.reduce_ops import ReduceOp
from commrt.runtime import bootstrap
from commrt.runtime.config import Config
from commrt.runtime.errors import CommError, ConfigError
from commrt.runtime.rendezvous import RendezvousSpec
from commrt.runtime.store import wait_for
from commrt.train.replica_vote import P, incarnation_key


def group_size(zero, local_world_size: int) -> int:
    """Ranks per replica group for ``[train] fault_tolerance = "replica"`` with the ZeRO config
    ``zero`` (a ``ZeroConfig``): the engine's shard group without fault tolerance, i.e.
    ``mics_shard_size``, HYBRID_SHARD's ``shard_group_size`` (0: the ranks per node), hpZ's
    ``zero_hpz_partition_size`` ("auto": the ranks per node); 1 (a replica is a rank) otherwise."""
    if zero.mics_shard_size > 0:
        return zero.mics_shard_size
    if zero.hybrid:
        return zero.shard_group_size or local_world_size
    hpz = zero.zero_hpz_partition_size
    return local_world_size if hpz == "auto" else hpz


def layout(rank: int, world_size: int, shards: int, local_world_size: int) -> tuple[int, int, int]:
    """(replica, replicas, shard) of global rank ``rank`` in groups of ``shards`` consecutive
    ranks (the launcher numbers a node's ranks consecutively). A group is part of one node or
    whole nodes: one holding parts of two nodes would be dropped with either of them."""
    if shards < 1 or world_size % shards:
        raise ConfigError(f"rank {rank}: replica groups of {shards} ranks do not divide the world of {world_size}")
    if local_world_size % shards and shards % local_world_size:
        raise ConfigError(f"rank {rank}: replica groups of {shards} ranks straddle nodes of {local_world_size} ranks "
                          "(LOCAL_WORLD_SIZE); give a group size that divides the node size or is a multiple of it")
    return rank // shards, world_size // shards, rank % shards


class GroupBroken(CommError):
    """A rank of this replica group failed: the group must be restarted as a whole."""


class ShardedGroup:
    """The intra-group half: the group's world, the flat layout, and the shard optimizer."""

    def __init__(self, model: torch.nn.Module, make_optimizer, replica: int, shard: int, shards: int):
        self.replica, self.shard, self.shards = replica, shard, shards
        self.params = [p for p in model.parameters() if p.requires_grad]
        total = sum(p.numel() for p in self.params)
        self.size = -(-total // shards)  # each shard's length; the last is padded
        self.lo = shard * self.size
        self.values = torch.zeros(self.size * shards)  # the parameters, flat (gathered after each step)
        self.shard_param = torch.nn.Parameter(torch.zeros(self.size))
        self.optimizer = make_optimizer([self.shard_param])
        self.rt = None
        self.incarnation = 0  # which start of the group (``join``)
        self._shard: torch.Tensor | None = None  # the step's reduce-scattered gradient, until applied

    def join(self, cfg: Config, host: str, port: int, store, timeout_s: float) -> bytes | None:
        """Open the group's world (rank = shard; every start of a rank counts, so a restarted
        group meets in a fresh one), then return the generation its first rank saw running
        (the store's ``cur``, None before the first): every rank of a (re)started group enters
        the same one."""
        inc = (store.add(f"{P}grp{self.replica}/starts", 1) - 1) // self.shards
        self.incarnation = inc + 1
        if self.shard == 0:  # the group's start, as a rank's (replica_vote.check_current)
            store.set(incarnation_key(self.replica), str(self.incarnation).encode())
        spec = RendezvousSpec(host, port, self.shard, self.shards)
        env = {k: v for k, v in os.environ.items() if k != "LOCAL_WORLD_SIZE"}
        self.rt = bootstrap.init_world(cfg, spec, env, store=(store, None), namespace=f"{P}grp{self.replica}/i{inc}/")
        key = f"{P}grp{self.replica}/i{inc}/cur"
        if self.shard == 0:
            raw = store.mget([P + "cur"])[0]
            store.set(key, b"-" if raw is None else bytes(raw))
        raw = bytes(wait_for(store, [key], timeout_s, f"replica group {self.replica}'s generation")[0])
        return None if raw == b"-" else raw

    def check(self) -> None:
        """Both halves alive (before registering for a generation): a barrier with the comm deadline."""
        self._call("barrier", lambda b: b.barrier(False))

    # -- ReplicaFT's gradient interface (as replica_overlap.Replicated) --------------------
    def prepare(self) -> None:
        """Once per step, after backward: a redo reuses it, so the group's ranks run the same
        intra-group collectives whatever their cross-replica worlds did."""
        self._shard = self.reduce_scatter()

    def arm(self, backend) -> None:
        pass

    def overlapped(self) -> bool:
        return False

    def flat(self, mine: bool) -> torch.Tensor:
        """A copy of the step's shard (zeros for a group without a gradient of the step)."""
        return self._shard.clone() if mine else torch.zeros(self.size)

    def reduce_scatter(self) -> torch.Tensor:
        """Shard ``s`` of the sum of the group's gradients."""
        local = torch.zeros(self.size * self.shards)
        torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.params],
                  out=local[:sum(p.numel() for p in self.params)])
        out = torch.empty(self.size)
        self._call("reduce_scatter", lambda b: b.reduce_scatter_tensor(out, local, ReduceOp.SUM, False))
        return out

    def apply(self, grad_shard: torch.Tensor, divisor: int) -> None:
        """Step the shard with the average, gather every shard into the model's parameters."""
        self._shard = None
        self.shard_param.grad = grad_shard.div_(divisor)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for p in self.params:
            p.grad = None
        self._call("all_gather", lambda b: b.all_gather_into_tensor(self.values, self.shard_param.data, False))
        self._scatter_to_model()

    def load_from_model(self) -> None:
        """After a state transfer: the model's parameters are current; take this rank's slice."""
        torch.cat([p.data.reshape(-1) for p in self.params], out=self.values[:sum(p.numel() for p in self.params)])
        with torch.no_grad():
            self.shard_param.copy_(self.values[self.lo:self.lo + self.size])

    def _scatter_to_model(self) -> None:
        offset = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(self.values[offset:offset + p.numel()].view_as(p))
                offset += p.numel()

    def _call(self, op: str, fn) -> None:
        try:
            fn(self.rt.world.backend)
        except CommError as exc:
            raise GroupBroken(f"replica group {self.replica}, shard rank {self.shard}: {op} inside the group "
                              f"failed ({exc}); the group cannot continue without it: restart it as a whole") from exc

    def close(self) -> None:
        if self.rt is not None:
            bootstrap.shutdown(self.rt)
            self.rt = None
