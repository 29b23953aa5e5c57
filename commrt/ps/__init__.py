"""Parameter server: sharded servers (``server``), the worker client (``PSClient``), the key
partition and the wire protocol."""
from .client import PSClient

__all__ = ["PSClient"]
