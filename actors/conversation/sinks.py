"""Event sinks: where a conversation's events go (RULES.md 9.12).

An ``EventSink`` is any object with ``emit(event)``. The conversation actor never calls it directly: the
facade wraps a local sink in a ``SinkActor`` on the caller's node and the conversation actor *tells* each
event to that actor's address, so a slow sink never blocks a turn and a sink may live in another process
than the conversation. Events from one conversation arrive in the order they were emitted
(FIFO per actor pair).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from actors.base import BusActor, Context
from actors.conversation.permissions import PermissionAsked
from actors.conversation.types import (
    LOOP_EVENTS,
    CompactionBoundary,
    MessageAppended,
    PlanProposed,
    TextDelta,
    TodoUpdated,
    ToolCallFinished,
    ToolCallStarted,
    ToolNotice,
    TurnFinished,
)
from transport.node import Node

log = logging.getLogger(__name__)

__all__ = ["CallbackSink", "EventSink", "NullSink", "RemoteSink", "SinkActor"]


EVENT_TYPES: tuple[type[Any], ...] = (
    MessageAppended,
    TurnFinished,
    CompactionBoundary,
    TextDelta,
    ToolCallStarted,
    ToolCallFinished,
    ToolNotice,
    *LOOP_EVENTS,
)
EVENT_TYPES = (*EVENT_TYPES, TodoUpdated, PlanProposed, PermissionAsked)  # people in the loop (issue 13)


class EventSink(Protocol):
    def emit(self, event: Any) -> None: ...


class NullSink:
    """Drops every event (the default sink)."""

    def emit(self, event: Any) -> None:
        pass


class CallbackSink:
    """Calls ``fn(event)`` for each event."""

    def __init__(self, fn: Callable[[Any], None]) -> None:
        self.fn = fn

    def emit(self, event: Any) -> None:
        self.fn(event)


class RemoteSink:
    """A sink reached over the bus: ``emit`` tells the event to the sink actor at ``address``."""

    def __init__(self, node: Node, address: str, *, src: str | None = None) -> None:
        self.node = node
        self.address = address
        self._src = src

    def emit(self, event: Any) -> None:
        self.node.tell(self.address, event, **({"src": self._src} if self._src else {}))

    def __repr__(self) -> str:
        return f"RemoteSink({self.address!r})"


class SinkActor(BusActor):
    """Serves one local ``EventSink`` on the bus: every told event is passed to ``sink.emit``."""

    def __init__(self, node: Node, address: str, *, sink: EventSink) -> None:
        super().__init__(node, address)
        self.sink = sink

    def handle(self, message: Any, ctx: Context) -> Any:
        if not isinstance(message, EVENT_TYPES):
            raise TypeError(f"{self.address}: {type(message).__name__} is not a conversation event")
        try:
            self.sink.emit(message)
        except Exception:
            log.exception("%s: event sink raised on %s", self.address, type(message).__name__)
        return None
