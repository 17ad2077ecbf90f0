"""The inference handle on this node, the Router in another process (``kbus node``), over ipc."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import KbusNode

from actors.app.wiring import registry
from actors.inference.handle import (
    HandleTerminated,
    PreparedRound,
    SessionInferenceEvent,
    SessionInferenceRequest,
)
from actors.router.client import RouterClient
from actors.runs.runtime import InferenceRuntime
from actors.types import ToolCall, ToolResult
from transport import Node, Peer

pytestmark = pytest.mark.integration

CONFIG = """
[node]
name = "brain"
bind = ["ipc://brain.sock"]
data_dir = "data"
[actors.router]
type = "router"
[providers.scripted]
kind = "scripted"
scripts = [
  [ { text = "let me compute", chunks = 2 },
    { call = { name = "calc", arguments = { expression = "6*7" } }, id = "call-1" },
    { text = "The answer is 42.", chunks = 4 },
    { usage = { input_tokens = 12, output_tokens = 6, total_tokens = 18 } } ],
]
[models.scripted]
provider = "scripted"
provider_model = "scripted-v1"
context_window = 4096
max_input_tokens = 4000
"""


def test_a_tool_call_turn_end_to_end_with_the_router_in_another_process(
    ipc_dir: Path, kbus_node: Callable[..., KbusNode], make_node: Callable[..., Node]
) -> None:
    """SI-01/05/06/08/19, RT-09 across processes: events, the call, the answer and the Router's receipt."""
    config = ipc_dir / "router.toml"
    config.write_text(CONFIG)
    kbus_node(config)
    app = make_node("app", registry=registry())
    # The handle actor reaches the Router through the node's I/O thread: connect before the first turn.
    app.connect(Peer("brain", f"ipc://{ipc_dir}/brain.sock"), wait=20)
    runtime = InferenceRuntime(app, "brain/router", timeout=20)
    assert runtime.resolve_model("scripted").provider_model == "scripted-v1"
    parent = uuid.uuid4()
    request = SessionInferenceRequest(
        user_id="u1",
        operation_id=parent,
        round=1,
        prepared=PreparedRound(
            input="FULL CONTEXT",
            provider_input="what is 6*7?",
            continuation=None,
            model="scripted",
            reasoning_effort="low",
            tool_description="tools: calc",
            timeout=30.0,
        ),
    )
    events: list[Any] = []
    with runtime.start_session_inference(request) as si:
        assert si.address.startswith("app/")  # the handle lives on this node
        for _ in range(20):
            event = si.next_event(timeout=20)
            events.append(event)
            if isinstance(event, SessionInferenceEvent.ToolCall):
                assert event.call_id == "call-1"
                assert event.call == ToolCall(name="calc", arguments={"expression": "6*7"})
                si.respond(event.call_id, ToolResult(success=True, output="42"), timeout=20)
            if isinstance(event, SessionInferenceEvent.Completed):
                break
        done = events[-1]
        assert [type(e).__name__ for e in events] == [
            "ProviderInput",
            "ToolCall",
            "ProviderInput",
            "UsageUpdated",
            "Completed",
        ]
        assert isinstance(done, SessionInferenceEvent.Completed)
        assert done.answer == "The answer is 42."
        assert done.usage is not None and done.usage.total_tokens == 18
        assert done.receipt.parent_operation_id == parent and done.receipt.status == "completed"
        assert RouterClient(app, "brain/router", timeout=20).receipt(si.operation_id) == done.receipt
        with pytest.raises(HandleTerminated):
            si.next_event(timeout=20)
    assert (ipc_dir / "data" / "receipts.sqlite3").exists()
