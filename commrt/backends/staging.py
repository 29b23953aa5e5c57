"""CUDA tensors on the CPU (zmq) backend: staged through pinned host memory.

``host_copy`` stages a whole tensor (D2H now, H2D write-back after the collective). ``Staged``
does the same in pieces for element-wise collectives (all_reduce): every piece's device-to-host
copy is queued at once on a side stream, the collective works on piece i as soon as its copy
has landed, and piece i goes back to the device on another stream while piece i+1 is on the
network, so the copies hide behind the transfer instead of adding to it.
"""
from __future__ import annotations

from typing import Callable

import torch


def host_copy(t: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
    """A flat pinned host copy of CUDA tensor ``t`` and the write-back to the device."""
    host = torch.empty(t.numel(), dtype=t.dtype, pin_memory=True)
    host.copy_(t.reshape(-1))  # ordered after the work queued on the caller's current stream

    def writeback() -> None:
        with torch.cuda.device(t.device):
            t.copy_(host.view(t.shape))  # synchronous: done when the Work completes
    return host, writeback


class Staged:
    def __init__(self, t: torch.Tensor, piece_bytes: int):
        self.t = t
        self.flat = t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)
        self.host = torch.empty(t.numel(), dtype=t.dtype, pin_memory=True)
        per = max(1, piece_bytes // t.element_size())
        self.bounds = [(a, min(a + per, t.numel())) for a in range(0, t.numel(), per)] or [(0, 0)]
        self.d2h, self.h2d = torch.cuda.Stream(t.device), torch.cuda.Stream(t.device)
        self.d2h.wait_stream(torch.cuda.current_stream(t.device))
        self.landed = []
        with torch.cuda.stream(self.d2h):
            for a, b in self.bounds:
                self.host[a:b].copy_(self.flat[a:b], non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.d2h)
                self.landed.append(event)

    def run(self, collective: Callable[[torch.Tensor], None]) -> None:
        """``collective(host_piece)`` in place on each piece, in order (the same on every rank)."""
        with torch.cuda.device(self.t.device):
            for (a, b), landed in zip(self.bounds, self.landed):
                landed.synchronize()
                collective(self.host[a:b])
                with torch.cuda.stream(self.h2d):
                    self.flat[a:b].copy_(self.host[a:b], non_blocking=True)
            self.h2d.synchronize()
            if self.flat.data_ptr() != self.t.data_ptr() or not self.t.is_contiguous():
                self.t.copy_(self.flat.view(self.t.shape))
                torch.cuda.current_stream(self.t.device).synchronize()
