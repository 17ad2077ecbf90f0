"""Codex adapter value types and config validation (RULES.md AD-01, AD-02, AD-03, AD-06, SH-01)."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path
from typing import Any

import pytest

from actors.app.wiring import registry
from actors.codex import facade as adapter_module
from actors.codex.child import LaunchOptions, child_argv
from actors.codex.messages import CODEX_MESSAGES
from actors.codex.types import (
    ASYNC_TOOL_ACKNOWLEDGEMENT,
    AdapterConfig,
    AdapterError,
    CodexToolCall,
    Done,
    DynamicTool,
    ErrorEvent,
    ErrorKind,
    TextDelta,
    ToolCallEvent,
    ToolResult,
)

TOOL = DynamicTool(name="t", description="d", input_schema={"type": "object"})


def config(**changes: Any) -> AdapterConfig:
    base = AdapterConfig(
        executable="/bin/codex",
        working_directory="/w",
        model="m",
        reasoning_effort=None,
        base_instructions="b",
        tools=(TOOL,),
    )
    return dataclasses.replace(base, **changes)


def test_ack_is_the_seed_string() -> None:
    """SH-01: byte for byte."""
    assert ASYNC_TOOL_ACKNOWLEDGEMENT == (
        "The tool was launched asynchronously. Its result will not be available during this turn. "
        "Do not wait for or poll this call; continue the turn without its result. "
        "The result will be provided in the next user turn."
    )


def test_config_fields_and_value_equality_and_round_trip() -> None:
    """AD-01: exactly the seed's fields; equal by value; a Path executable and a list of tools normalise."""
    assert [f.name for f in dataclasses.fields(AdapterConfig)] == [
        "executable",
        "working_directory",
        "model",
        "reasoning_effort",
        "base_instructions",
        "tools",
    ]
    assert config() == config(executable=Path("/bin/codex"), tools=[TOOL])
    reg = registry()
    for value in (config(), TOOL, CodexToolCall(call_id="c", name="n", arguments={"a": [1, 2.5, None]})):
        assert reg.decode(value.TAG, reg.encode(value)) == value


def test_error_kinds_and_error_equality_and_wire() -> None:
    """AD-02: the kinds; str contains the message; diagnostics take part in equality; crosses the bus."""
    assert {k.name for k in ErrorKind} == {
        "BUSY",
        "INTERRUPTED",
        "INVALID_TOOL_RESULT",
        "LAUNCH_REJECTED",
        "PROTOCOL",
        "SERVER",
        "UNAVAILABLE",
    }
    assert "m" in str(AdapterError(ErrorKind.BUSY, "m", b""))
    assert AdapterError(ErrorKind.BUSY, "m", b"") == AdapterError(ErrorKind.BUSY, "m", b"")
    assert AdapterError(ErrorKind.BUSY, "m", b"a") != AdapterError(ErrorKind.BUSY, "m", b"b")
    reg = registry()
    error = AdapterError(ErrorKind.SERVER, "boom", b"\xff\x00")
    reply = reg.error_reply(error)
    again = reg.rebuild_error(reg.decode(reply.TAG, reg.encode(reply)))
    assert type(again) is AdapterError and again == error


def test_every_event_variant_round_trips_and_matches() -> None:
    """AD-03."""
    reg = registry()
    events = [
        TextDelta("a"),
        ToolCallEvent(CodexToolCall(call_id="c", name="n", arguments={"x": 1})),
        Done(),
        ErrorEvent(AdapterError(ErrorKind.INTERRUPTED, "i", b"d")),
    ]
    for event in events:
        assert reg.decode(event.TAG, reg.encode(event)) == event
    kinds = []
    for event in events:
        match event:
            case TextDelta(text):
                kinds.append(("text", text))
            case ToolCallEvent(call):
                kinds.append(("call", call.call_id))
            case Done():
                kinds.append(("done", None))
            case ErrorEvent(error):
                kinds.append(("error", error.kind))
    assert kinds == [("text", "a"), ("call", "c"), ("done", None), ("error", ErrorKind.INTERRUPTED)]
    assert ToolResult(success=True, output="o") == ToolResult(success=True, output="o")


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"executable": ""}, "executable"),
        ({"model": ""}, "model"),
        ({"reasoning_effort": ""}, "reasoning_effort"),
        ({"tools": (TOOL, TOOL)}, "tools[1].name"),
        ({"tools": (dataclasses.replace(TOOL, name=""),)}, "tools[0].name"),
        ({"tools": (dataclasses.replace(TOOL, input_schema=[1]),)}, "tools[0].input_schema"),
    ],
)
def test_invalid_config_is_rejected_before_anything_is_spawned(
    monkeypatch: pytest.MonkeyPatch, changes: dict[str, Any], field: str
) -> None:
    """AD-06: UNAVAILABLE naming the field, and no process spawned (a spy on Popen)."""
    spawned: list[Any] = []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: spawned.append(a))
    with pytest.raises(AdapterError) as err:
        adapter_module.Adapter.open(config(**changes), timeout=5)
    assert err.value.kind is ErrorKind.UNAVAILABLE
    assert field in err.value.message
    assert spawned == []


def test_child_command_line_is_hermetic() -> None:
    """CODEX.md: the native binary, app-server, no plugins/shell snapshot/analytics, fail-fast retries."""
    argv = child_argv(config(), LaunchOptions(model_base_url="http://127.0.0.1:9/v1"), "/c.json")
    assert argv[:2] == ["/bin/codex", "app-server"]
    joined = " ".join(argv)
    for flag in ("plugins", "shell_snapshot", "unbounded_connection_retries", "analytics.enabled=false"):
        assert flag in joined
    assert "request_max_retries = 0" in joined and "http://127.0.0.1:9/v1" in joined


@pytest.mark.parametrize("cls", CODEX_MESSAGES, ids=lambda c: c.TAG)
def test_every_codex_message_round_trips(cls: type[Any]) -> None:
    """MB-06 for the adapter's messages, with the codec tests' generic strategy."""
    from hypothesis import HealthCheck, given, settings
    from unit.transport.test_codec import strategy_for

    reg = registry()

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(strategy_for(cls))
    def round_trip(message: Any) -> None:
        assert reg.decode(cls.TAG, reg.encode(message)) == message

    round_trip()
