"""Shared pieces of the ConversationRuntime tests: a CaptureSink, gate tools, script steps."""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from actors.conversation import ToolRegistry

WAIT = 10.0


def call(name: str, call_id: str, **arguments: Any) -> dict[str, Any]:
    return {"call": {"name": name, "arguments": arguments}, "id": call_id}


def text(body: str, chunks: int = 1) -> dict[str, Any]:
    return {"text": body, "chunks": chunks}


def usage(input_tokens: int, output_tokens: int = 1, cached: int = 0) -> dict[str, Any]:
    return {
        "usage": {
            "input_tokens": input_tokens,
            "output_tokens": output_tokens,
            "cached_input_tokens": cached,
            "total_tokens": input_tokens + output_tokens,
        }
    }


class CaptureSink:
    """Keeps every event in arrival order; ``wait_for`` blocks (bounded) until one matches."""

    def __init__(self) -> None:
        self.events: list[Any] = []
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def emit(self, event: Any) -> None:
        self._inbox.put(event)

    def _drain(self) -> None:
        while True:
            try:
                self.events.append(self._inbox.get_nowait())
            except queue.Empty:
                return

    def of(self, *kinds: type[Any]) -> list[Any]:
        self._drain()
        return [e for e in self.events if isinstance(e, kinds)]

    def wait_for(self, predicate: Callable[[Any], bool], timeout: float = WAIT) -> Any:
        deadline = time.monotonic() + timeout
        self._drain()
        for e in self.events:
            if predicate(e):
                return e
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError("no matching event arrived")
            try:
                event = self._inbox.get(timeout=remaining)
            except queue.Empty:
                raise AssertionError("no matching event arrived") from None
            self.events.append(event)
            if predicate(event):
                return event


class Gates:
    """Tools that block on the host until the test opens them: ``gate(name)``; ``entered[name]`` is set
    when the tool started."""

    def __init__(self) -> None:
        self.entered: collections.defaultdict[str, threading.Event] = collections.defaultdict(threading.Event)
        self.opened: collections.defaultdict[str, threading.Event] = collections.defaultdict(threading.Event)
        self.runs: list[str] = []

    def register(self, tools: ToolRegistry) -> ToolRegistry:
        def gate(key: str) -> str:
            """Wait until the test opens the gate ``key``."""
            self.runs.append(key)
            self.entered[key].set()
            if not self.opened[key].wait(WAIT):
                raise TimeoutError(f"gate {key} never opened")
            return f"gate {key} opened"

        tools.register(gate)
        return tools

    def wait_entered(self, name: str) -> None:
        assert self.entered[name].wait(WAIT), f"gate {name} never entered"

    def open(self, name: str) -> None:
        self.opened[name].set()
