"""commrt: a communication runtime for distributed training (ZeroMQ/TCP ring collectives,
NCCL and gloo behind one torch.distributed-style API)."""
from commrt.collectives.reduce_ops import ReduceOp
from commrt.runtime.config import Config, load_config
from commrt.distributed import (all_gather_into_tensor, all_reduce, all_to_all_single, barrier, broadcast,
    destroy_process_group, get_backend, get_config, get_rank, get_world_group, get_world_size,
    init_process_group, irecv, is_initialized, isend, new_group, recv, reduce, reduce_scatter_tensor, send)
from commrt.runtime.errors import (CollectiveMismatch, CommError, ConfigError, GroupClosed, PeerLost,
    ProtocolError, RendezvousError, RequestRejected)
from commrt.runtime.group import NON_GROUP_MEMBER, ProcessGroup
from commrt.pipeline.p2p import P2POp, batch_isend_irecv
from commrt.topology.mesh import (DeviceMesh, get_local_rank, get_local_world_size, get_node_rank,
    get_num_nodes, get_process_group_ranks, init_device_mesh)
from commrt.obs.stats import comm_stats
from commrt.distributed import comms_summary, dump_flight_record
from commrt.obs.stats import register as register_comm_stats
from commrt.topology.dispatch import auto_stats as _hierarchical_auto

# commrt.comm_stats()["hierarchical_auto"]: what [comm] hierarchical = "auto" measured and chose
register_comm_stats("hierarchical_auto", _hierarchical_auto)
from commrt.runtime.work import CommTimeout, Work
from commrt import quant  # noqa: E402,F401 (commrt.quant; registers comm_stats()["quant"])

__version__ = "0.1.0"

__all__ = [
    "ReduceOp", "Config", "load_config", "init_process_group", "destroy_process_group",
    "is_initialized", "get_world_group", "get_rank", "get_world_size", "get_backend", "get_config", "new_group",
    "all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "broadcast", "reduce",
    "all_to_all_single", "barrier", "send", "recv", "isend", "irecv", "P2POp", "batch_isend_irecv", "Work", "ProcessGroup",
    "NON_GROUP_MEMBER", "CommError", "ConfigError", "PeerLost", "CollectiveMismatch",
    "ProtocolError", "RendezvousError", "RequestRejected", "CommTimeout", "GroupClosed",
    "get_local_rank", "get_local_world_size", "get_node_rank", "get_num_nodes", "init_device_mesh",
    "DeviceMesh", "get_process_group_ranks", "comm_stats", "register_comm_stats",
    "comms_summary", "dump_flight_record",
]

from commrt.integrations.tdist import register_backend as _register_torch_backend  # noqa: E402

_register_torch_backend()  # torch.distributed.init_process_group("commrt") (commrt/tdist)
