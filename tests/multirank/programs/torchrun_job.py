"""Run under torchrun: commrt must rendezvous through the agent's store."""
import torch

import commrt

commrt.init_process_group(backend="zmq")
t = torch.ones(1000) * (commrt.get_rank() + 1)
commrt.all_reduce(t)
n = commrt.get_world_size()
assert torch.all(t == n * (n + 1) / 2), t[:4]
commrt.destroy_process_group()
print("torchrun job passed", flush=True)
