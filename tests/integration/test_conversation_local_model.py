"""A ConversationRuntime on the real embedded model (SmolLM2-135M): the catalog entry forces one tool call,
then ``tool_choice_after_call = "none"`` makes the model answer in text, so each turn ends STOP with one
step and the transcript holds the call with its result."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from peers.conversation_kit import CaptureSink

from actors.app.wiring import registry
from actors.conversation import (
    ConversationRuntime,
    FinishReason,
    ToolCallFinished,
    ToolRegistry,
    TurnFinished,
    read_journal,
)
from actors.router.actor import RouterActor
from actors.router.catalog import ModelCatalog
from transport import Node

pytestmark = pytest.mark.integration

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


def test_two_turns_on_the_embedded_model_with_one_tool(
    make_node: Callable[..., Node], tmp_path: Path
) -> None:
    node = make_node("n1", registry=registry())
    node.spawn(RouterActor, "router", catalog=ModelCatalog.from_mapping(CATALOG), data_dir=tmp_path)
    calls: list[tuple[str, str]] = []

    def weather(city: str) -> str:
        """Today's weather in a city."""
        calls.append(("weather", city))
        return f"Sunny, 21 degrees Celsius in {city}."

    tools = ToolRegistry()
    tools.register(weather)
    sink = CaptureSink()
    rt = (
        ConversationRuntime.builder()
        .node(node)
        .llm("smol-tools")
        .tools(tools)
        .system_prompt("You answer questions about the weather with the weather tool.")
        .session_file(tmp_path / "chat.jsonl")
        .event_sink(sink)
        .max_steps(2)
        .round_timeout(240.0)
        .timeout(300.0)
        .build()
    )
    try:
        for question in ("What is the weather in Paris?", "And in Rome?"):
            outcome = rt.run(question)
            # The 135M model's answer may run on to its output-token limit: the turn then says so (length).
            assert outcome.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
            assert outcome.steps == 1  # forced once, then "none": no call loop
            assert outcome.final_text.strip()
        sink.wait_for(lambda e: isinstance(e, TurnFinished) and e.turn_index == 1, timeout=30)
        transcript = rt.transcript()
        assert [m.role for m in transcript] == ["user", "assistant", "tool", "assistant"] * 2
        assert {c.id for m in transcript for c in m.tool_calls} == {
            m.tool_call_id for m in transcript if m.role == "tool"
        }
        assert len(sink.of(ToolCallFinished)) == 2
        assert read_journal(tmp_path / "chat.jsonl").transcript == transcript
    finally:
        rt.stop()
