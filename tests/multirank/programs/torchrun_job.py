"""Run under torchrun: commrt must rendezvous through the agent's store, under its own API and as
the torch.distributed backend "commrt" (env://, then tcp:// on a port rank 0 picks)."""
import datetime
import os

import torch
import torch.distributed as dist

import commrt

commrt.init_process_group(backend="zmq")
t = torch.ones(1000) * (commrt.get_rank() + 1)
commrt.all_reduce(t)
n = commrt.get_world_size()
assert torch.all(t == n * (n + 1) / 2), t[:4]
commrt.destroy_process_group()


def torch_backend_sum(rank: int) -> None:
    t = torch.ones(1000) * (rank + 1)
    dist.all_reduce(t)
    assert dist.get_backend() == "commrt" and torch.all(t == n * (n + 1) / 2), t[:4]


dist.init_process_group("commrt")  # env://, the variables torchrun set
rank = dist.get_rank()
torch_backend_sum(rank)
store = dist.distributed_c10d._get_default_store()
if rank == 0:
    from commrt.launch import free_port
    store.set("tcp_port", str(free_port()))
port = int(store.get("tcp_port"))  # torch's store waits with its own timeout
dist.destroy_process_group()
# under torchrun torch's tcp:// expects the agent to serve every store (it serves MASTER_PORT
# only): this store on another port is rank 0's own, as outside torchrun (gloo would wait too)
os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
dist.init_process_group("commrt", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n,
                        timeout=datetime.timedelta(seconds=60))
torch_backend_sum(rank)
dist.destroy_process_group()
print(f"torchrun job passed (commrt API, torch backend env:// and tcp://, pid {os.getpid()})", flush=True)
