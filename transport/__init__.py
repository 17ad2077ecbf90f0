"""The wire: envelope, codec, typed errors, nodes and sockets, security, capture and replay.

Knows nothing of agents; ``actors`` builds on it (``config <- transport <- actors``).
"""

from transport.codec import JsonValue, Registry
from transport.envelope import Address, Header, Inbound
from transport.errors import (
    ActorUnavailable,
    BusError,
    BusTimeout,
    ErrorRegistry,
    Expired,
    HandlerError,
    LimitExceeded,
    NotDelivered,
    ProtocolError,
    RemoteError,
    Unavailable,
)
from transport.node import Node
from transport.pending import BlockingCallInActor, BusFuture, Reply
from transport.security import KeyPair, Security, SecurityError
from transport.sockets import Peer

__all__ = [
    "ActorUnavailable",
    "Address",
    "BlockingCallInActor",
    "BusError",
    "BusFuture",
    "BusTimeout",
    "ErrorRegistry",
    "Expired",
    "HandlerError",
    "Header",
    "Inbound",
    "JsonValue",
    "KeyPair",
    "LimitExceeded",
    "Node",
    "NotDelivered",
    "Peer",
    "ProtocolError",
    "Registry",
    "RemoteError",
    "Reply",
    "Security",
    "SecurityError",
    "Unavailable",
]
