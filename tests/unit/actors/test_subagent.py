"""The single-turn subagent run over the real Router (scripted provider) and a RunHostActor around a
RecordingHost (RULES.md SA-01..SA-28, EV-01..EV-06, C.4)."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from actors.inference import InferenceRuntime, InferenceTimeout
from actors.nodes import registry
from actors.projection import (
    REMOVED_MARKER,
    RUN_TOOL_DESCRIPTION,
    UPDATED_MARKER,
    Projection,
    estimate_tokens,
    rejection_text,
)
from actors.router.actor import RouterActor
from actors.router.catalog import ModelCatalog, ModelEntry, ProviderEntry
from actors.router.providers.scripted import ScriptedProvider
from actors.subagent import (
    AuditEvent,
    CaptureFailedError,
    ContextBudget,
    ContextCapacityError,
    EmptyAnswerError,
    EmptyCaptureError,
    RunHostActor,
    RunRequest,
    RunResult,
    StateUpdate,
    SubagentHostError,
    ToolOutcome,
)
from actors.types import ToolCall, UsageReceipt
from transport.node import Node

OP = uuid.UUID("00000000-0000-4000-8000-0000000000bb")
WAIT = 10.0
RESERVE = 100


def catalog(max_input_tokens: int = 30000) -> ModelCatalog:
    return ModelCatalog(
        (
            ModelEntry(
                model="sub",
                provider="scripted",
                provider_model="scripted-sub",
                aliases=("alias",),
                context_window=max(max_input_tokens, 32768),
                max_input_tokens=max_input_tokens,
            ),
        ),
        (ProviderEntry(name="scripted", kind="scripted"),),
    )


def call(call_id: str, name: str = "t", **arguments: Any) -> dict[str, Any]:
    return {"call": {"name": name, "arguments": arguments}, "id": call_id}


class RecordingHost:
    """The application's Host: every call in one ordered trace, scripted outcomes by tool name."""

    def __init__(self, provider: ScriptedProvider) -> None:
        self.provider = provider
        self.trace: list[tuple[Any, ...]] = []
        self.outcomes: dict[str, Callable[[ToolCall, ContextBudget], Any]] = {}
        self.capture_outcome: Callable[[str], Any] = lambda contents: ToolOutcome.success(f"saved {contents}")
        self.fail_on: str | None = None
        self.budgets: list[ContextBudget] = []

    def _check(self, name: str) -> None:
        if self.fail_on == name:
            raise SubagentHostError(f"{name} failed")

    def render_tool_call(self, call: ToolCall) -> str:
        self.trace.append(("render", call.name))
        self._check("render")
        return f"CALL {call.name} {call.arguments}"

    def execute_tool(self, call: ToolCall, operation_id: uuid.UUID, budget: ContextBudget) -> Any:
        # What the provider has been answered so far: respond(n) must come before execute_tool(n+1).
        self.trace.append(("execute_tool", call.name, operation_id, len(self.provider.results)))
        self.budgets.append(budget)
        self._check("execute_tool")
        make = self.outcomes.get(call.name, lambda c, b: ToolOutcome.success(f"{c.name} ok"))
        return make(call, budget)

    def complete_capture(self, capture: Any, contents: str, budget: ContextBudget) -> Any:
        self.trace.append(("complete_capture", capture, contents, budget))
        self._check("complete_capture")
        return self.capture_outcome(contents)

    def record(self, event: Any) -> None:
        self.trace.append(("record", event))
        self._check("record")
        if self.fail_on == type(event).__name__:
            raise SubagentHostError(f"record {type(event).__name__} failed")

    # ------------------------------------------------------------------------------ views
    def events(self, kind: type[Any] | None = None) -> list[Any]:
        return [e[1] for e in self.trace if e[0] == "record" and (kind is None or isinstance(e[1], kind))]

    def names(self) -> list[str]:
        return [e[0] if e[0] != "record" else type(e[1]).__name__ for e in self.trace]


@pytest.fixture
def node(make_node: Callable[..., Node]) -> Node:
    return make_node("n1", registry=registry())


@pytest.fixture
def provider() -> ScriptedProvider:
    return ScriptedProvider()


@pytest.fixture
def max_input() -> int:
    return 30000


@pytest.fixture
def router(node: Node, provider: ScriptedProvider, tmp_path: Path, max_input: int) -> RouterActor:
    ref = node.spawn(
        RouterActor, "router", catalog=catalog(max_input), data_dir=tmp_path, providers={"scripted": provider}
    )
    return ref  # type: ignore[no-any-return]


@pytest.fixture
def runtime(node: Node, router: Any) -> InferenceRuntime:
    return InferenceRuntime(node, "n1/router", timeout=WAIT)


@pytest.fixture
def host(node: Node, provider: ScriptedProvider) -> RecordingHost:
    app = RecordingHost(provider)
    node.spawn(RunHostActor, "host", host=app)
    return app


def request(**fields: Any) -> RunRequest:
    values: dict[str, Any] = {
        "user_id": "u1",
        "parent_operation_id": OP,
        "model": "alias",
        "reasoning_effort": "low",
        "context": ("CTX-A tools: t(x)", "CTX-B"),
        "task": "TASK do it",
        "timeout": None,
        "start_metadata": {"who": "tester", "n": [1, 2]},
    }
    values.update(fields)
    return RunRequest(**values)


def go(runtime: InferenceRuntime, **fields: Any) -> RunResult:
    result: RunResult = runtime.run(request(**fields), "n1/host", timeout=WAIT, protocol_reserve_tokens=RESERVE)
    return result


def estimate(projection: str) -> int:
    """The independent computation: the scripted provider has no tokenizer, so every piece of P is counted
    with the conservative estimate (a piece is counted on its own, so sum over the pieces)."""
    return estimate_tokens(projection)


# ----------------------------------------------------------------------------------------------- basics


def test_sa01_sa23_ev01_ev05_ev06_a_plain_answer(
    runtime: InferenceRuntime, host: RecordingHost, provider: ScriptedProvider
) -> None:
    """SA-01, SA-23, EV-01, EV-05, EV-06: one resolution; Started first with the resolved model's fields;
    Completed last with the answer; every event carries the parent operation."""
    provider.add([{"text": "the answer"}])
    result = go(runtime)
    assert result.answer == "the answer"
    assert result.model.model == "sub" and result.model.requested == "alias"
    events = host.events()
    started = events[0]
    assert isinstance(started, AuditEvent.Started)
    assert (started.model, started.provider_model, started.max_input_tokens) == ("sub", "scripted-sub", 30000)
    assert started.context_window_tokens == 32768 and started.provider == "scripted"
    assert started.context == ("CTX-A tools: t(x)", "CTX-B") and started.task == "TASK do it"
    assert started.host == {"who": "tester", "n": [1, 2]}
    assert [type(e).__name__ for e in events] == [
        "Started",
        "InferenceSubmitted",
        "ProviderReceipt",
        "Completed",
    ]
    assert events[-1] == AuditEvent.Completed(parent_operation_id=OP, model="sub", response="the answer")
    assert all(e.parent_operation_id == OP for e in events)
