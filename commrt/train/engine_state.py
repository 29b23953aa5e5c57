"""The engine's state (part of ``engine.Engine``): the consolidated parameters, its shard's
state dict, checkpoints (``train/checkpoint.py``) and what it holds in memory."""
from __future__ import annotations

import torch

from commrt.train import checkpoint


class EngineState:
    """Mixed into ``Engine``: reads ``module``, ``names``, ``zero`` and ``dtype``."""

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Consolidated fp32 parameters by name (a collective: every rank must call it); frozen
        parameters as the model holds them, in fp32."""
        out = {n: p.detach().float() if p.is_floating_point() else p.detach().clone()
               for n, p in self.module.named_parameters() if not p.requires_grad}
        for u in self.zero.units:
            flat = self.zero.full_master(u)
            for i, shape, off, n in zip(u.layout.params, u.shapes, u.layout.offsets, u.layout.numels):
                out[self.names[i]] = flat[off:off + n].view(shape).clone()
        return out

    def state_dict(self) -> dict:
        self.zero.settle_all()
        return checkpoint.shard_state(self)

    def load_state_dict(self, state: dict) -> None:
        self._check_open("load_state_dict")
        self.zero.settle_all()
        checkpoint.load_shard_states(self, [state])
        self._dirty = False  # the load dropped the gradients

    def save_checkpoint(self, directory: str) -> str:
        self.zero.settle_all()
        return checkpoint.save(self, directory)

    def load_checkpoint(self, directory: str) -> None:
        self._check_open("load_checkpoint")
        self.zero.settle_all()
        checkpoint.load(self, directory)
        self._dirty = False  # the load dropped the gradients

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients and optimizer state."""
        z = self.zero
        params = sum(u.master.numel() * 4 for u in z.units if z.stage == 3 or self.dtype != torch.float32)
        if z.stage < 3:
            params += sum(u.full.numel() * u.full.element_size() for u in z.units)
        params += sum(u.secondary.numel() * u.secondary.element_size() for u in z.units if u.secondary is not None)
        grads = sum(u.grad.numel() * u.grad.element_size() for u in z.units)
        # zero_defer: reduced shards not yet added into u.grad (in flight or held) are live too
        grads += sum(t.numel() * t.element_size() for t in
                     [u.landing.args[1] for u in z.units if u.landing is not None] + [out for _, out in z.held])
        state = sum(t.numel() * t.element_size() for u in z.units for t in u.state.values())
        frozen = sum(p.numel() * p.element_size() for p in self.module.parameters() if not p.requires_grad)
        return {"parameters": params + frozen, "gradients": grads, "optimizer_state": state,
                "gathered_peak": z.peak_live_bytes, "total": params + frozen + grads + state}
