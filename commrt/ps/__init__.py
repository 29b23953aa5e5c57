"""Parameter server: sharded servers (``server``), the worker client (``PSClient``), the key
partition and the wire protocol. ``PSClient`` loads on first use: a server shard imports this
package too, and never torch (the client's tensors)."""
from __future__ import annotations

import importlib

__all__ = ["PSClient"]


def __getattr__(name: str):
    if name == "PSClient":
        return importlib.import_module("commrt.ps.client").PSClient
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
