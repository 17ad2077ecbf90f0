"""``ToolHostActor``: serves a ``ToolRegistry`` on the bus (the conversation's host placement).

Tools run on this actor's thread, one call at a time; a tool that raises gives ``ToolExecution(ok=False)``
and the actor lives on. It may run in another process than the conversation (``builder().host(address)``):
start it there with ``node.spawn(ToolHostActor, name, registry=registry)``.
"""

from __future__ import annotations

from typing import Any

from actors.base import BusActor, Context
from actors.conversation.messages import BindSink, ExecuteTool, ListTools, ToolList
from actors.conversation.sinks import RemoteSink
from actors.conversation.tools import ToolRegistry
from transport.node import Node

__all__ = ["ToolHostActor"]


class ToolHostActor(BusActor):
    # Tools run on this thread and may never return: a daemon thread lets the process exit (after an explicit
    # stop has given up on a busy tool) instead of waiting on it forever.
    use_daemon_thread = True

    def __init__(self, node: Node, address: str, *, registry: ToolRegistry) -> None:
        super().__init__(node, address)
        self.registry = registry

    def handle(self, message: Any, ctx: Context) -> Any:
        match message:
            case ExecuteTool(name=name, arguments=arguments):
                return self.registry.execute(name, arguments)
            case ListTools():
                return ToolList(specs=self.registry.specs())
            case BindSink(address=address):
                sink = RemoteSink(self.node, address, src=self.address) if address is not None else None
                self.registry.bind_sink(sink)
                return None
        raise TypeError(f"{self.address}: unexpected {type(message).__name__}")
