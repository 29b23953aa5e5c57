"""Transport layer: ZeroMQ sockets, framing, deadlines. Knows nothing about collectives."""
from .endpoint import Endpoint, Message

__all__ = ["Endpoint", "Message"]
