"""run_session on the real embedded model: the model's tool call reaches the host and the loop completes."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from actors.app.wiring import registry
from actors.inference.handle import PreparedRound
from actors.router.actor import RouterActor
from actors.router.catalog import ModelCatalog
from actors.runs.session import (
    HostActor,
    ProviderResume,
    RoundCompletion,
    RoundPreparation,
    SessionControl,
    SessionRunRequest,
    SessionToolOutcome,
    run_session,
)
from actors.types import ToolCall, ToolCallError
from transport import Node

pytestmark = pytest.mark.integration

# The 135M model is steered, not trusted: the first request must call the tool (grammar-forced), the one
# after the result must answer in text. A bigger model would run with "auto" both times.
CATALOG = {
    "providers": {
        "smol": {
            "kind": "local",
            "tool_choice": "required",
            "tool_choice_after_call": "none",
            "temperature": 0.0,
            "seed": 7,
            "max_output_tokens": 48,
        }
    },
    "models": {
        "smol-tools": {
            "provider": "smol",
            "provider_model": "SmolLM2-135M-Instruct",
            "context_window": 4096,
            "max_input_tokens": 3500,
        }
    },
}
TASK = (
    "You can look up the weather with the tool `weather`. Call call_ktool with "
    '{"name": "weather", "arguments": {"city": "Paris"}}, then answer in one sentence. '
    "What is the weather in Paris?"
)


class WeatherApp:
    """A SessionHost offering one tool."""

    def __init__(self) -> None:
        self.calls: list[ToolCall | ToolCallError] = []
        self.answers: list[str] = []

    def prepare_round(self, round: int) -> Any:
        if round > 1:
            return RoundPreparation.Complete(answer=self.answers[-1] if self.answers else None)
        return RoundPreparation.Run(
            prepared=PreparedRound(
                input=TASK,
                provider_input=TASK,
                continuation=None,
                model="smol-tools",
                reasoning_effort="",
                tool_description="Application tools: weather(city) returns today's weather.",
                timeout=240.0,
            )
        )

    def record(self, event: Any) -> None:
        pass

    def execute_tool(self, call: ToolCall | ToolCallError, provider_operation_id: uuid.UUID) -> Any:
        self.calls.append(call)
        if isinstance(call, ToolCallError):
            return SessionToolOutcome.failure(str(call))
        return SessionToolOutcome.success("Sunny, 21 degrees Celsius.")

    def prepare_provider_resume(self, outcome: SessionToolOutcome) -> Any:
        return ProviderResume.Continue(outcome=outcome)

    def complete_capture(self, capture: Any, contents: str) -> Any:
        return SessionControl.Complete(answer=contents)

    def complete_round(self, completion: RoundCompletion) -> Any:
        self.answers.append(completion.answer)
        return SessionControl.Complete(answer=completion.answer)


def test_run_session_on_the_embedded_model_with_one_tool(
    make_node: Callable[..., Node], tmp_path: Path
) -> None:
    node = make_node("n1", registry=registry())
    node.spawn(RouterActor, "router", catalog=ModelCatalog.from_mapping(CATALOG), data_dir=tmp_path)
    app = WeatherApp()
    node.spawn(HostActor, "host", host=app)
    request = SessionRunRequest(user_id="u1", operation_id=uuid.uuid4(), rounds_used=0, round_limit=3)
    answer = run_session(node, "n1/router", request, "n1/host", timeout=300)
    assert len(app.calls) == 1, app.calls  # the model's call reached the host (parsed or bounded error)
    call = app.calls[0]
    if isinstance(call, ToolCall):
        assert isinstance(call.arguments, dict)
    assert answer is not None and answer.strip()
    assert app.answers == [answer]
