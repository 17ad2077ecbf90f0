"""A goal loop on the real embedded model (SmolLM2-135M) with the default judge on the Router (issue 12).

The judge's turn carries the verdict's JSON schema, so the local provider generates the verdict under a
grammar built from it; whatever the small model decides, the loop ends within ``max_turns`` with the goal
events in order, and every provider turn (the turns and the judge calls) has one receipt. A second test
shows the schema is what makes the verdicts parse: its judge entry never calls a tool (``tool_choice =
"none"``, free text without the schema), and every verdict of several judge calls parses.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from peers.conversation_kit import CaptureSink

from actors.app.wiring import registry
from actors.conversation import ConversationRuntime, ToolRegistry, read_journal
from actors.conversation.types import GoalAchieved, GoalCleared, GoalContinuing, GoalSet
from actors.router.actor import RouterActor
from actors.router.catalog import ModelCatalog
from actors.router.client import RouterClient
from transport import Node

pytestmark = pytest.mark.integration

MODEL = {"provider_model": "SmolLM2-135M-Instruct", "context_window": 4096, "max_input_tokens": 3500}
CATALOG = {
    "providers": {
        "chat": {
            "kind": "local",
            "tool_choice": "none",
            "temperature": 0.0,
            "seed": 7,
            "max_output_tokens": 32,
        },
        "judge": {
            "kind": "local",
            "tool_choice": "required",
            "temperature": 0.0,
            "seed": 7,
            "max_output_tokens": 128,
        },
        "text-judge": {
            "kind": "local",
            "tool_choice": "none",
            "temperature": 0.0,
            "seed": 7,
            "max_output_tokens": 128,
        },
    },
    "models": {
        "smol-chat": {"provider": "chat", **MODEL},
        "smol-judge": {"provider": "judge", **MODEL},
        "smol-text-judge": {"provider": "text-judge", **MODEL},
    },
}


def test_a_goal_loop_on_the_embedded_model_ends_within_max_turns_with_one_receipt_per_provider_turn(
    make_node: Callable[..., Node], tmp_path: Path
) -> None:
    node = make_node("n1", registry=registry())
    node.spawn(RouterActor, "router", catalog=ModelCatalog.from_mapping(CATALOG), data_dir=tmp_path)
    sink = CaptureSink()
    operation = uuid.uuid4()
    session = tmp_path / "s.jsonl"
    rt = (
        ConversationRuntime.builder()
        .node(node)
        .llm("smol-chat")
        .judge_model("smol-judge")
        .tools(ToolRegistry())
        .event_sink(sink)
        .session_file(session)
        .operation_ids(lambda: operation)
        .timeout(600.0)
        .build()
    )
    try:
        outcomes = rt.run_goal_loop("Say the word 'blue'.", "The assistant said the word blue.", 3)
        end = sink.wait_for(lambda e: isinstance(e, GoalAchieved | GoalCleared), timeout=60)
        events = sink.of(GoalSet, GoalContinuing, GoalAchieved, GoalCleared)
        assert 1 <= len(outcomes) <= 3
        assert isinstance(events[0], GoalSet) and events[-1] == end
        assert all(isinstance(e, GoalContinuing) for e in events[1:-1])
        judged = (
            len(events) - 2 + (0 if isinstance(end, GoalCleared) and end.reason == "budget_exceeded" else 1)
        )
        if isinstance(end, GoalCleared):
            assert end.reason in ("budget_exceeded", "impossible")
            assert end.reason != "budget_exceeded" or len(outcomes) == 3
        receipts = RouterClient(node, "n1/router").receipts_for(operation, timeout=60)
        assert len(receipts) == len(outcomes) + judged
        assert len({r.receipt_id for r in receipts}) == len(receipts)
        assert rt.current_goal() is None and read_journal(session).loops.goal is None
        print(
            "goal loop on smollm2:",
            [type(e).__name__ for e in events],
            [getattr(e, "reason", "") for e in events],
        )
    finally:
        rt.stop()


GOALS = [
    ("Say the word 'blue'.", "The assistant said the word blue."),
    ("Name a fruit.", "The assistant named a fruit."),
    ("Count to three.", "The assistant counted from one to three."),
    ("Write a haiku about rain.", "The assistant wrote a haiku that mentions rain."),
]


def test_every_verdict_of_the_schema_constrained_judge_parses(
    make_node: Callable[..., Node], tmp_path: Path
) -> None:
    """The judge's answers are constrained by ``VERDICT_SCHEMA``: four goal loops (max_turns=2, so each asks
    the judge at most once per loop, after turn 1), a judge model that answers in text (no tool call), and
    every journaled verdict is one the judge gave, never "did not parse"."""
    node = make_node("n1", registry=registry())
    node.spawn(RouterActor, "router", catalog=ModelCatalog.from_mapping(CATALOG), data_dir=tmp_path)
    session = tmp_path / "s.jsonl"
    rt = (
        ConversationRuntime.builder()
        .node(node)
        .llm("smol-chat")
        .judge_model("smol-text-judge")
        .tools(ToolRegistry())
        .session_file(session)
        .timeout(600.0)
        .build()
    )
    try:
        for prompt, condition in GOALS:
            rt.run_goal_loop(prompt, condition, 2)
        verdicts = [r for r in records(session) if r["type"] == "goal_verdict"]
        assert len(verdicts) == len(GOALS)
        assert [v["reason"] for v in verdicts if "did not parse" in v["reason"]] == []
        assert all(v["reason"].strip() for v in verdicts)
        print("schema-constrained verdicts:", [(v["achieved"], v["reason"]) for v in verdicts])
    finally:
        rt.stop()


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
