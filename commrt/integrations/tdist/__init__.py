"""commrt as a ``torch.distributed`` backend: ``import commrt`` registers "commrt", then
``torch.distributed.init_process_group("commrt")`` runs DDP, FSDP2, DeviceMesh and pipelining
on commrt's transport. Above commrt's own API; nothing below imports it."""
from commrt.integrations.tdist.process_group import CommrtProcessGroup
from commrt.integrations.tdist.register import NAME, create_group
from commrt.integrations.torch_plugin import register_backend
from commrt.integrations.tdist.work import TorchWork

__all__ = ["CommrtProcessGroup", "TorchWork", "NAME", "create_group", "register_backend"]
