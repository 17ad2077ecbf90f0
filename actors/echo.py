"""The built-in echo actor: answers pings and benchmarks, streams on request, fails on request."""

from __future__ import annotations

from typing import Any

from actors.base import DEFER, BusActor, Context
from transport.errors import HandlerError
from transport.messages import Echo, EchoStream, Fail, Hold


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
                for i in range(count):
                    ctx.partial(Echo(payload=payload, seq=i))
                return Echo(payload=payload, seq=count)
            case Hold():
                return DEFER  # answered only by on_stop (Unavailable), or never if the process dies
            case Fail(error="", message=text):
                raise RuntimeError(text)
            case Fail(error=wire, message=text):
                cls = self.node.registry.errors.lookup(wire) or HandlerError
                raise cls(text)
        raise TypeError(f"echo does not handle {type(message).__name__}")
