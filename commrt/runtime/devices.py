"""Which GPU each rank would drive under NCCL, checked across the job before NCCL starts.

NCCL needs one GPU per rank. Without a GPU, ``set_device(local_rank % device_count())`` divides
by zero on every rank, and a rank that fails after opening torch's store leaves the others
waiting for it the whole timeout (issue 31 item 1); two ranks on one GPU get NCCL's raw
"Duplicate GPU detected" at the first collective (issue 30 item 9). Each rank therefore
describes its GPU in its hello, and every rank reads the same table and reaches the same
verdict at once, before any NCCL state exists.
"""
from __future__ import annotations

from commrt.topology.nodes import Topology


def describe(local_rank: int) -> dict:
    """This rank's GPU for NCCL: ``{"device": "cuda:i", "uuid": ...}`` or ``{"cause": why not}``."""
    import torch  # lazy: asked only of an NCCL world
    if not torch.cuda.is_available():
        return {"cause": "CUDA is not available on this host"}
    count = torch.cuda.device_count()
    if count == 0:
        return {"cause": "no CUDA device is visible (CUDA_VISIBLE_DEVICES?)"}
    index = local_rank % count
    try:  # the UUID tells two indices apart that map to one GPU (CUDA_VISIBLE_DEVICES per rank)
        uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", index))
    except Exception:  # noqa: BLE001 -- an older driver: the index is the best name we have
        uuid = str(index)
    return {"device": f"cuda:{index}", "uuid": uuid}


def problems(gpus: list[dict], layout: Topology) -> list[str]:
    """Why NCCL cannot run on this job (empty: it can), the same list on every rank."""
    out = [f"rank {r}: {g['cause']}" for r, g in enumerate(gpus) if "cause" in g]
    if out:
        return out
    sharing: dict = {}
    for r, g in enumerate(gpus):
        sharing.setdefault((layout.node_of[r], g["uuid"]), []).append(r)
    for (node, _), ranks in sorted(sharing.items(), key=lambda kv: kv[1]):
        if len(ranks) > 1:
            names = ", ".join(str(r) for r in ranks)
            out.append(f"ranks {names} share GPU {gpus[ranks[0]]['device']} on node {node}: NCCL needs "
                       "one GPU per rank; run one rank per GPU, or set [comm] backend = \"auto\" "
                       "(zmq, which lets ranks share a GPU)")
    return out
