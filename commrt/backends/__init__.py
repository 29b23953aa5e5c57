"""Backends behind one interface: ours (zmq) and torch.distributed's (gloo, nccl)."""
