"""The built-in echo actor: answers pings and benchmarks, streams on request, fails on request.

Its work is bounded by what a message may ask for: the limits are documented with the messages
(``transport.messages``: ``ECHO_MAX_STREAM_PARTS``, ``ECHO_MAX_STREAM_BYTES``, ``ECHO_MAX_HELD``); a request
past one gets ``LimitExceeded`` and nothing runs.
"""

from __future__ import annotations

from typing import Any

from actors.base import DEFER, BusActor, Context
from transport.errors import HandlerError, LimitExceeded, ProtocolError
from transport.messages import (
    ECHO_MAX_HELD,
    ECHO_MAX_STREAM_BYTES,
    ECHO_MAX_STREAM_PARTS,
    Echo,
    EchoStream,
    Fail,
    Hold,
)


class EchoActor(BusActor):
    """Sends back what it receives. Stateless apart from a count of what it handled."""

    DIRECT = True  # ping and the benchmarks measure the fastest path a blocking caller can take

    def __init__(self, node: Any, address: str) -> None:
        super().__init__(node, address)
        self.handled = 0

    def handle(self, message: Any, ctx: Context) -> Any:
        self.handled += 1
        match message:
            case Echo():
                return message
            case EchoStream(count=count, payload=payload):
                if not 0 <= count <= ECHO_MAX_STREAM_PARTS:
                    raise LimitExceeded(
                        f"echo.stream count {count} is not 0 to {ECHO_MAX_STREAM_PARTS}",
                        field="count",
                        limit=ECHO_MAX_STREAM_PARTS,
                    )
                if count * len(payload) > ECHO_MAX_STREAM_BYTES:
                    raise LimitExceeded(
                        f"echo.stream of {count} x {len(payload)} bytes exceeds {ECHO_MAX_STREAM_BYTES}",
                        field="payload",
                        limit=ECHO_MAX_STREAM_BYTES,
                    )
                for i in range(count):
                    ctx.partial(Echo(payload=payload, seq=i))
                return Echo(payload=payload, seq=count)
            case Hold():
                if len(self._open) >= ECHO_MAX_HELD:
                    raise LimitExceeded(f"echo holds {ECHO_MAX_HELD} requests already", limit=ECHO_MAX_HELD)
                # Answered only by on_stop (Unavailable); forgotten at its deadline; lost if the process dies.
                return DEFER
            case Fail(error="", message=text):
                raise RuntimeError(text)
            case Fail(error=wire, message=text):
                cls = self.node.registry.errors.lookup(wire) or HandlerError
                raise cls(text)
        # A registered message echo has no use for: the sender's mistake, not a bug here.
        raise ProtocolError(f"echo does not handle {type(message).__name__}")
