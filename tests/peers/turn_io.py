"""``RecordingTurnIO``: the Router's end of a provider turn, faked for provider tests."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from actors.router.providers.base import ProviderEvent
from actors.types import ToolResult


class RecordingTurnIO:
    """A fake Router end of a turn (a test double): records events, answers tool calls, runs a hook
    on each event (a test cancels from there)."""

    def __init__(
        self,
        results: Callable[[str], ToolResult] | None = None,
        on_emit: Callable[[RecordingTurnIO, ProviderEvent], None] | None = None,
    ) -> None:
        self.cancelled = threading.Event()
        self.events: list[ProviderEvent] = []
        self.waited: list[str] = []
        self._results = results or (lambda call_id: ToolResult(success=True, output="Sunny, 21 degrees"))
        self._on_emit = on_emit

    def emit(self, event: ProviderEvent) -> None:
        self.events.append(event)
        if self._on_emit is not None:
            self._on_emit(self, event)

    def wait_result(self, call_id: str) -> ToolResult:
        self.waited.append(call_id)
        return self._results(call_id)

    def of(self, kind: type[Any]) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind)]
