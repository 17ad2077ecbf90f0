"""A Router stopped while a provider turn runs (Ctrl-C in ``kbus chat``): the turn's worker thread ends
quietly instead of dying with ActorDeadError (pytest turns an unhandled thread exception into an error)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from pathlib import Path

from actors.app.wiring import registry
from actors.router.actor import RouterActor
from actors.router.client import RouterClient
from actors.router.messages import StartTurn, TurnTextDelta
from actors.router.providers.scripted import ScriptedProvider
from transport import Node


def test_a_router_stopped_mid_turn_ends_the_worker_thread_quietly(
    make_node: Callable[..., Node], tmp_path: Path
) -> None:
    node = make_node("n1", registry=registry())
    provider = ScriptedProvider([[{"text": "thinking"}, {"hang": True}]])
    ref = node.spawn(RouterActor, "router", data_dir=tmp_path, providers={"scripted": provider})
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
    worker = next(t for t in threading.enumerate() if t.name == f"kbus-turn-{started.operation_id}")
    ref.stop(block=True, timeout=10)  # cancels the hanging turn; its worker reports to a stopped Router
    worker.join(10)
    assert not worker.is_alive()
