"""A Router stopped while a provider turn runs (Ctrl-C in ``kbus chat``): the turn ends quietly, wherever it
was hosted, instead of dying with ActorDeadError (pytest turns an unhandled thread exception into an error),
and no thread it ran on outlives the Router (the node's loop pool it is placed on is the node's)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from actors.app.wiring import registry
from actors.base import LOOP_HOSTS, HostPool
from actors.router.actor import RouterActor
from actors.router.client import RouterClient
from actors.router.messages import StartTurn, TurnTextDelta
from actors.router.providers.base import ProviderError, ProviderOutcome, TextDelta, TurnIO, TurnRequest
from actors.router.providers.scripted import ScriptedProvider
from transport import Node


class HangingBlocking:
    """A provider with only a blocking ``run_turn`` (a test double): it streams, then blocks until the turn
    is cancelled, so it runs on a worker actor of the Router's pool."""

    name = "scripted"

    def run_turn(self, request: TurnRequest, io: TurnIO) -> ProviderOutcome:
        io.emit(TextDelta("thinking"))
        io.cancelled.wait(30)
        raise ProviderError("cancelled", "turn cancelled", started=True)

    def close(self) -> None:
        pass


@pytest.mark.parametrize(
    "provider",
    [
        pytest.param(lambda: ScriptedProvider([[{"text": "thinking"}, {"hang": True}]]), id="inline"),
        pytest.param(HangingBlocking, id="pool"),
    ],
)
def test_a_router_stopped_mid_turn_ends_the_turn_quietly(
    make_node: Callable[..., Node], tmp_path: Path, provider: Callable[[], Any]
) -> None:
    node = make_node("n1", registry=registry())
    HostPool.of(node, LOOP_HOSTS).hosts()  # the thread the Router is placed on: the node's, not the Router's
    before = {t.ident for t in threading.enumerate()}
    ref = node.spawn(RouterActor, "router", data_dir=tmp_path, providers={"scripted": provider()})
    router = RouterClient(node, "n1/router", timeout=10)
    started = router.start_turn(
        StartTurn(
            user_id="u1",
            parent_operation_id=uuid.uuid4(),
            model="scripted",
            input="hi",
            tool_description="no tools",
        )
    )
    while not isinstance(router.next_event(started.operation_id), TurnTextDelta):
        pass  # TurnInput first; each next_event is bounded by the client's timeout
    ref.stop(block=True, timeout=10)  # cancels the hanging turn; its host reports to a stopped Router
    left = [t for t in threading.enumerate() if t.ident not in before]
    for thread in left:
        thread.join(10)
    assert [t.name for t in left if t.is_alive()] == []
