"""Provider turns have no thread each (issue 15 item 5; DESIGN.md 2: threads grow with the actors a
deployment configures, never with the number of sessions): N concurrent turns, each waiting on a tool call,
leave the process's thread count where one turn leaves it: none for the scripted model (the Router steps
its turns itself), at most ``turn_workers`` for a provider placed on the pool."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from actors.app.wiring import registry
from actors.router.actor import RouterActor
from actors.router.client import RouterClient
from actors.router.messages import StartTurn, TurnCompleted, TurnToolCall
from actors.router.providers.base import (
    AwaitResult,
    NativeToolCall,
    ProviderOutcome,
    Submitted,
    TextDelta,
    ToolCallRequested,
    TurnIO,
    TurnRequest,
    TurnSteps,
    model_context,
)
from actors.router.providers.scripted import ScriptedProvider
from actors.types import CALL_KTOOL, ToolResult
from transport.node import Node

N = 24
CALL = {"call": {"name": "x", "arguments": {}}, "id": "c1"}


class PooledStepped:
    """A stepped provider placed on the Router's worker pool (a test double shaped like a blocking HTTP
    provider): one tool call, then the answer."""

    name = "scripted"
    placement = "pool"

    def steps(self, request: TurnRequest, io: TurnIO) -> TurnSteps:
        io.emit(Submitted(model_context(request)))
        io.emit(ToolCallRequested(NativeToolCall("c1", CALL_KTOOL, '{"name": "x", "arguments": {}}')))
        result = yield AwaitResult("c1")
        assert result is not None
        io.emit(TextDelta(result.output))
        return ProviderOutcome(result.output, None)

    def run_turn(self, request: TurnRequest, io: TurnIO) -> ProviderOutcome:
        raise AssertionError("the Router hosts stepped turns")

    def close(self) -> None:
        pass


def names() -> list[str]:
    return sorted(t.name for t in threading.enumerate())


def run_concurrently(router: RouterClient, n: int) -> list[str]:
    """Start ``n`` turns, read each to its tool call (all are then open at once), take the thread names,
    answer them all and read each to its completion."""
    ops = [
        router.start_turn(
            StartTurn(
                user_id="u1",
                parent_operation_id=uuid.uuid4(),
                model="scripted",
                input="go",
                tool_description="run a tool",
            )
        ).operation_id
        for _ in range(n)
    ]
    for op in ops:
        while not isinstance(router.next_event(op), TurnToolCall):
            pass
    during = names()
    for op in ops:
        router.respond(op, "c1", ToolResult(success=True, output="ok"))
    for op in ops:
        while not isinstance(router.next_event(op), TurnCompleted):
            pass
    return during


@pytest.mark.parametrize(
    ("provider", "workers", "grows_by"),
    [
        pytest.param(lambda: ScriptedProvider(default=[CALL, {"text": "done"}]), 2, 0, id="inline"),
        pytest.param(PooledStepped, 2, 2, id="pool"),
    ],
)
def test_the_thread_count_does_not_grow_with_concurrent_turns(
    make_node: Callable[..., Node], tmp_path: Path, provider: Callable[[], Any], workers: int, grows_by: int
) -> None:
    node = make_node("n1", registry=registry())
    node.spawn(
        RouterActor, "router", data_dir=tmp_path, providers={"scripted": provider()}, turn_workers=workers
    )
    router = RouterClient(node, "n1/router", timeout=10)
    router.stats()  # the Router has started (and its housekeeping ticker with it)
    before = names()
    few = run_concurrently(router, workers)  # as many turns as the pool may have workers
    many = run_concurrently(router, N)
    more = run_concurrently(router, 2 * N)
    assert few == many == more, (few, many, more)
    assert len(many) == len(before) + grows_by, (before, many)
