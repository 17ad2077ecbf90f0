"""Shared pieces of the ConversationRuntime tests: a CaptureSink, gate tools, script steps."""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from actors.conversation import ConversationRuntime, ToolNotice, ToolRegistry
from actors.conversation.tools import EventSinkLike
from actors.router.actor import RouterActor
from actors.router.catalog import ModelCatalog
from actors.router.providers.scripted import ScriptedProvider
from transport.node import Node

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


def _model(provider: str) -> dict[str, Any]:
    return {
        "provider": provider,
        "provider_model": provider,
        "context_window": 32768,
        "max_input_tokens": 30000,
    }


CATALOG = ModelCatalog.from_mapping(
    {
        "providers": {"p1": {"kind": "scripted"}, "p2": {"kind": "scripted"}},
        "models": {"m1": _model("p1"), "m2": _model("p2")},
    }
)


class Env:
    """One node with a Router over two scripted providers (models m1 and m2), and the runtimes built."""

    def __init__(self, node: Node, tmp: Path) -> None:
        self.node = node
        self.tmp = tmp
        self.p1 = ScriptedProvider()
        self.p2 = ScriptedProvider()
        node.spawn(
            RouterActor, "router", catalog=CATALOG, data_dir=tmp, providers={"p1": self.p1, "p2": self.p2}
        )
        self.gates = Gates()
        self.tools = self.gates.register(ToolRegistry())
        self.notes: list[str] = []

        def note(message: str, sink: EventSinkLike | None = None) -> str:
            """Emit a notice through the sink this tool holds."""
            if sink is not None:
                sink.emit(ToolNotice(tool="note", data={"message": message}))
            return "noted"

        def add(a: int, b: int) -> int:
            """Add two integers."""
            return a + b

        self.tools.register(note)
        self.tools.register(add)
        self.sink = CaptureSink()
        self.built: list[ConversationRuntime] = []

    def build(self, **options: Any) -> ConversationRuntime:
        b = ConversationRuntime.builder().node(self.node).llm(options.pop("llm", "m1")).tools(self.tools)
        b.event_sink(options.pop("sink", self.sink)).timeout(WAIT)
        for key, value in options.items():
            getattr(b, key)(value)
        rt = b.build()
        self.built.append(rt)
        return rt

    def script(self, *steps: dict[str, Any]) -> None:
        self.p1.add(list(steps))


def env_fixture(make_node: Callable[..., Node], tmp_path: Path) -> Iterator[Env]:
    """The body of an ``env`` fixture: one node ``n1`` with the Router and the runtimes' cleanup."""
    from actors.app.wiring import registry

    e = Env(make_node("n1", registry=registry()), tmp_path)
    yield e
    for rt in e.built:
        rt.stop()
