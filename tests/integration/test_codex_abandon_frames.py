"""TU-06 on the real codex binary, asserted on the frames the adapter writes to the child.

Every line the adapter actor writes to the child's stdin is an ``effect`` record ``stdin <line>`` of its
node's capture (``actors/codex/actor.py``), so the capture is the exact list of frames the child was sent.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from peers.codex_support import start_model_server, weather_config

from actors.app.wiring import registry
from actors.codex.child import LaunchOptions
from actors.codex.facade import Adapter, Turn
from actors.codex.messages import Abandon
from actors.codex.types import Done, ToolCallEvent
from transport import Node
from transport.capture import CaptureWriter, iter_records

pytestmark = pytest.mark.integration

T = 30.0
DELIVERY_WAIT = 90.0  # the whole wait for one child line to reach the actor
SCRIPT = [
    {"text": ["hi"]},  # turn k1
    {"text": ["hi"]},  # turn k2
    {"tool_calls": [{"call_id": "call_1", "name": "get_weather", "arguments": {"city": "Paris"}}]},  # k3
    {"text": ["after"]},
]


def frames_to_child(node: Node, log: Path) -> list[dict[str, Any]]:
    assert node.capture is not None
    node.capture.flush(T)
    return [
        json.loads(r.frames[0][len(b"stdin ") :])
        for r in iter_records(log)
        if r.at == "effect" and r.frames[0].startswith(b"stdin ")
    ]


def until_delivered(node: Node, log: Path, needle: bytes) -> None:
    """Until the adapter actor has taken in a child output line holding ``needle`` (its capture records a
    delivery as the actor starts handling it, so anything asked after this is handled after it)."""
    assert node.capture is not None
    # Bounded by time, not by a count of looks: under load codex may take longer than 2,000 looks (that
    # was this test's flake, issue 18); each look waits for the capture's writer to flush.
    deadline = time.monotonic() + DELIVERY_WAIT
    while time.monotonic() < deadline:
        node.capture.flush(T)
        if any(
            r.at == "deliver" and r.actor == "cx/codex" and needle in r.frames[1] for r in iter_records(log)
        ):
            return
    raise AssertionError(f"the actor never took in {needle!r}")


def until_done(turn: Turn) -> None:
    for _ in range(100):
        if isinstance(turn.next_event(timeout=T), Done):
            return
    raise AssertionError("no Done")


@pytest.fixture
def adapter_with_capture(
    spawn_peer: Callable[..., Any], tmp_path: Path, make_node: Callable[..., Node]
) -> tuple[Adapter, Node, Path]:
    server = start_model_server(spawn_peer, tmp_path, SCRIPT)
    log = tmp_path / "cx.buslog"
    capture = CaptureWriter(log, node="cx", schema=registry().schema_hash())
    node = make_node("cx", registry=registry(), capture=capture)  # make_node stops it (and reaps the child)
    adapter = Adapter.open(
        weather_config(tmp_path), bus=node, name="codex", launch=LaunchOptions(model_base_url=server.base_url)
    )
    return adapter, node, log


def test_tu06_abandoning_a_finished_turn_or_twice_sends_the_child_nothing(
    adapter_with_capture: tuple[Adapter, Node, Path],
) -> None:
    """TU-06: ``abandon()`` after ``Done``, again, and the actor's own ``Abandon`` for that turn from
    another sender (not through this facade) write no frame to the child. The control: abandoning an
    active turn writes exactly one ``turn/interrupt``."""
    adapter, node, log = adapter_with_capture
    # Finished in the actor (the child said turn/completed) but its Done not yet taken by the caller.
    finished = adapter.start_turn("k1", "hello", timeout=T)
    until_delivered(node, log, b"turn/completed")
    before = frames_to_child(node, log)
    finished.abandon(timeout=T)
    finished.abandon(timeout=T)
    for _ in range(2):  # straight to the actor: the facade's own check cannot hide the actor's
        node.request(adapter.address, Abandon(turn_id=finished.turn_id), timeout=T)
    assert frames_to_child(node, log) == before
    # Finished and its Done delivered.
    delivered = adapter.start_turn("k2", "hello", timeout=T)
    until_done(delivered)
    before = frames_to_child(node, log)
    delivered.abandon(timeout=T)
    node.request(adapter.address, Abandon(turn_id=delivered.turn_id), timeout=T)
    assert frames_to_child(node, log) == before

    active = adapter.start_turn("k3", "weather?", timeout=T)
    assert isinstance(active.next_event(timeout=T), ToolCallEvent)
    sent = len(frames_to_child(node, log))
    active.abandon(timeout=T)
    node.request(adapter.address, Abandon(turn_id=active.turn_id), timeout=T)  # twice: still one
    after = frames_to_child(node, log)[sent:]
    assert [f["method"] for f in after] == ["turn/interrupt"], after
