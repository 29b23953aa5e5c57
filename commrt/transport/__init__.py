"""Transport layer: ZeroMQ sockets, framing, deadlines. Knows nothing about collectives."""
from commrt.transport.endpoint import Endpoint, Message
from commrt.transport.transport import Counters, Transport

__all__ = ["Counters", "Endpoint", "Message", "Transport"]
