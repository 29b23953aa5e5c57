"""The rows of ``commrt bench train`` that are not commrt's engine: torch's DDP and FSDP2 (one
``fully_shard`` per transformer block, then the root) over gloo and over the ``commrt`` torch
backend, and the measurements every row shares: bytes sent per step inside / across nodes and
the peak resident memory of the rank.

torch's groups are made once per run: the default group on gloo (its TCPStore on a free port,
told to the other ranks through commrt's own broadcast) and ``new_group(backend="commrt")``.
Bytes are counted where commrt's transports count them: ``commrt.comm_stats()`` for the engine,
the torch backend's own transport for the ``commrt`` groups; gloo's are not visible ("n/a").
"""
from __future__ import annotations

import ctypes
import datetime
import gc
import resource
import warnings

import torch.distributed as tdist
from torch import nn

import commrt
from commrt.integrations.tdist import register as tdist_register
from commrt.obs.stats import split_by_node
from commrt.runtime import torch_init

STORE_TIMEOUT = datetime.timedelta(seconds=120)


class TorchGroups:
    """torch.distributed's default group on gloo and one group on the ``commrt`` backend."""

    def __init__(self):
        rank, world = commrt.get_rank(), commrt.get_world_size()
        # served by rank 0 on MASTER_ADDR only (where its commrt store is), not on every interface
        store = torch_init.shared_store(rank, STORE_TIMEOUT.total_seconds(), commrt.broadcast)
        with torch_init.gloo_interface(commrt.get_config()):
            tdist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=STORE_TIMEOUT)
        self.groups = {"gloo": tdist.group.WORLD, "commrt": tdist.new_group(backend="commrt")}

    def close(self) -> None:
        tdist.destroy_process_group()


def ddp(model: nn.Module, group) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel
    return DistributedDataParallel(model, process_group=group)


def fsdp(model: nn.Module, group) -> nn.Module:
    """FSDP2 as its docs shard a transformer: each block, then the root (embeddings, head)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    # the root returns the head's output reshaped by the loss, which torch warns about on every step
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("shard",))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


WRAPPERS = {"ddp": ddp, "fsdp": fsdp}


def bytes_sent(where: str) -> tuple[int, int] | None:
    """(inside, across nodes) bytes this rank has sent so far over ``where``'s transport:
    "engine" (commrt's own world), "commrt" (the torch backend's), None where not countable."""
    if where == "engine":
        s = commrt.comm_stats()
        return s["intra_node_bytes"], s["inter_node_bytes"]
    if where == "commrt":
        transport = tdist_register._shared["transport"]  # the backend's one Transport per process
        if transport is None:
            return None
        counters = transport.counters
        s = split_by_node(counters.sent_by_op(), counters.same_node or [True] * commrt.get_world_size())
        return s["intra_node_bytes"], s["inter_node_bytes"]
    return None


def reset_peak_memory() -> None:
    """Start a new resident-set high-water mark (Linux: writing 5 to clear_refs resets VmHWM to
    the current RSS), after collecting the previous strategy's garbage and returning it to the
    system."""
    gc.collect()
    try:  # glibc keeps freed heap mapped: hand it back, or each row's peak includes the last's
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass  # then the mark is the process's since its start (ru_maxrss below)


def peak_memory_mb() -> float:
    """The resident-set high-water mark since ``reset_peak_memory`` (MiB)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
