"""RS-15 and RS-24 as the rules say them, checked where the provider can see it (issue 18 item 11: both could
be broken with the session tests green). The real Router with its scripted provider, in this process: the
provider's ``results`` list every tool result that reached it, so "no native response" and "the response,
then the interrupt" are facts of the provider, not of the host's trace.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from unit.actors.test_session import WAIT, RecordingHost, request_of, tool

from actors.app.wiring import registry
from actors.router.actor import RouterActor
from actors.router.providers.scripted import ScriptedProvider
from actors.runs.session import (
    HostActor,
    ProviderResume,
    SessionEvent,
    SessionToolOutcome,
    run_session_future,
)
from actors.types import ToolResult
from transport.node import Node


@pytest.fixture
def provider() -> ScriptedProvider:
    return ScriptedProvider()


@pytest.fixture
def host(
    make_node: Callable[..., Node], tmp_path: Path, provider: ScriptedProvider
) -> tuple[Node, RecordingHost]:
    node = make_node("n1", registry=registry())
    node.spawn(RouterActor, "router", data_dir=tmp_path, providers={"scripted": provider})
    app = RecordingHost(provider)
    node.spawn(HostActor, "host", host=app)
    return node, app


def provider_results(provider: ScriptedProvider, n: int) -> list[tuple[str, ToolResult]]:
    """The provider's results once it holds ``n`` (bounded by WAIT; a lost response fails here)."""
    ready = threading.Event()
    deadline = time.monotonic() + WAIT
    while len(provider.results) < n and time.monotonic() < deadline:
        ready.wait(0.01)
    return list(provider.results)


def run(node: Node) -> Any:
    return run_session_future(node, "n1/router", request_of(), "n1/host", timeout=WAIT).result(WAIT + 1)


def test_rs24_stop_sends_the_response_then_accounts_the_turn_as_interrupted(
    host: tuple[Node, RecordingHost], provider: ScriptedProvider
) -> None:
    """RS-24: Continue(o2 with stop=True) → the provider gets the response, then an interrupt; None."""
    node, app = host
    provider.add([tool("c1"), {"hang": True}])  # after the response the turn runs on until interrupted
    app.tool = lambda call: SessionToolOutcome(text="x", ok=True, stop=True)
    assert run(node) is None
    # the response reached the provider: its turn thread reads it, before the interrupt, on its own time
    assert provider_results(provider, 1) == [("c1", ToolResult(success=True, output="x"))]
    (receipt,) = app.events(SessionEvent.ProviderReceipt)
    assert receipt.receipt.status == "interrupted"  # ...and then the interrupt ended its turn
    names = app.names()
    assert "complete_round" not in names and "complete_capture" not in names
    assert app.rounds() == [1]


def test_rs15_complete_at_the_resume_boundary_sends_no_response(
    host: tuple[Node, RecordingHost], provider: ScriptedProvider
) -> None:
    """RS-15: Complete(answer) sends no native response; the interrupted call is accounted; answer."""
    node, app = host
    provider.add([tool("c1"), {"text": "never"}])
    app.resume = lambda outcome: ProviderResume.Complete(answer="early")
    assert run(node) == "early"
    assert provider.results == []  # no tool result reached the provider
    (receipt,) = app.events(SessionEvent.ProviderReceipt)
    assert receipt.receipt.status == "interrupted"
    assert app.names()[-2:] == ["resume", "ProviderReceipt"]
    assert app.rounds() == [1]
