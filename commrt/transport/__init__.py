"""Transport layer: ZeroMQ sockets, framing, deadlines. Knows nothing about collectives."""
from .endpoint import Endpoint, Message
from .hub import Counters, Transport

__all__ = ["Counters", "Endpoint", "Message", "Transport"]
