"""Parameter server: sharded servers (``server``), the worker client (``PSClient``), the key
partition and the wire protocol."""
from commrt.ps.client import PSClient

__all__ = ["PSClient"]
