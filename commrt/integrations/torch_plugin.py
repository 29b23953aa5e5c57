"""The "commrt" entry in torch.distributed's backend table, registered without importing commrt's
transport: ``import commrt`` registers it right after torch loads, which can happen in the middle
of importing one of commrt's own modules (the transport imports torch); importing the backend's
implementation there would meet that module half-initialised. The implementation
(integrations/tdist) is imported when torch first asks for a group."""
from __future__ import annotations

import datetime
import functools
import sys

NAME = "commrt"


def register_backend() -> None:
    """Make ``init_process_group("commrt")`` and ``new_group(backend="commrt")`` work. Cheap and
    idempotent. gloo/nccl stay torch's defaults for cpu/cuda."""
    import torch.distributed as dist
    if NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu", "cuda"])
    route_torch_api(_is_ours)  # torch refuses non-gloo groups by name


def _create(opts, backend_options=None):
    from commrt.integrations.tdist.register import create
    return create(opts, backend_options)


def _is_ours(pg) -> bool:
    impl = sys.modules.get("commrt.integrations.tdist.process_group")
    return impl is not None and isinstance(pg, impl.CommrtProcessGroup)


def route_torch_api(is_ours) -> None:
    """Make ``torch.distributed.monitored_barrier`` serve groups for which ``is_ours(pg)`` holds
    (torch itself raises "only implemented for GLOO backend" for them). Idempotent."""
    import torch.distributed as dist
    c10d = dist.distributed_c10d
    original = c10d.monitored_barrier
    if getattr(original, "__commrt__", False):
        return

    @functools.wraps(original)
    def wrapper(group=None, timeout=None, wait_all_ranks=False):
        if c10d._rank_not_in_group(group):
            return original(group, timeout, wait_all_ranks)
        pg = c10d._get_default_group() if group is None else group
        if not is_ours(pg):
            return original(group, timeout, wait_all_ranks)
        if isinstance(timeout, (int, float)):
            timeout = datetime.timedelta(seconds=timeout)
        return pg.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)

    wrapper.__commrt__ = True
    c10d.monitored_barrier = dist.monitored_barrier = wrapper
