"""commrt: a communication runtime for distributed training (ZeroMQ/TCP ring collectives,
NCCL and gloo behind one torch.distributed-style API).

The public API loads on first use (PEP 562), so ``import commrt`` and ``commrt --help`` do not
pay for torch. ``import commrt`` still registers the "commrt" torch.distributed backend: at once
when torch is loaded already, else as soon as ``import torch`` completes.
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
import sys

__version__ = "0.1.0"

_API = {
    "commrt.collectives.reduce_ops": ["ReduceOp"],
    "commrt.runtime.config": ["Config", "load_config"],
    "commrt.distributed": [
        "init_process_group", "destroy_process_group", "is_initialized", "get_world_group", "get_rank",
        "get_world_size", "get_backend", "get_config", "new_group", "all_reduce", "reduce_scatter_tensor",
        "all_gather_into_tensor", "broadcast", "reduce", "all_to_all_single", "barrier", "send", "recv",
        "isend", "irecv", "comms_summary", "dump_flight_record"],
    "commrt.pipeline.p2p": ["P2POp", "batch_isend_irecv"],
    "commrt.runtime.work": ["Work", "CommTimeout"],
    "commrt.runtime.group": ["ProcessGroup", "NON_GROUP_MEMBER"],
    "commrt.runtime.errors": ["CommError", "ConfigError", "PeerLost", "CollectiveMismatch", "ProtocolError",
                              "RendezvousError", "RequestRejected", "GroupClosed", "OpRefused"],
    "commrt.topology.mesh": ["get_local_rank", "get_local_world_size", "get_node_rank", "get_num_nodes",
                             "init_device_mesh", "DeviceMesh", "get_process_group_ranks"],
    "commrt.obs.stats": ["comm_stats"],
}
_RENAMED = {"register_comm_stats": ("commrt.obs.stats", "register")}
_WHERE = {name: (module, name) for module, names in _API.items() for name in names} | _RENAMED
__all__ = list(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        module, attr = _WHERE[name]
        value = getattr(importlib.import_module(module), attr)
    elif not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f"{__name__}.{name}")  # a subpackage, e.g. commrt.quant
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


def _register_torch_backend() -> None:
    """torch.distributed.init_process_group("commrt") (commrt/integrations/torch_plugin.py)."""
    from commrt.integrations.torch_plugin import register_backend
    register_backend()


class _WhenTorchLoads:
    """A meta-path finder that registers the backend right after ``import torch`` completes
    (torch imports torch.distributed itself), then steps aside."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torch")
        if spec is not None and spec.loader is not None:
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                try:
                    _register_torch_backend()
                except Exception as exc:  # torch imported fine: say why "commrt" is missing there
                    logging.getLogger(__name__).warning("torch backend 'commrt' not registered: %s", exc)
            spec.loader.exec_module = exec_module
        return spec


if "torch" in sys.modules:
    _register_torch_backend()
elif not any(isinstance(f, _WhenTorchLoads) for f in sys.meta_path):
    sys.meta_path.insert(0, _WhenTorchLoads())
