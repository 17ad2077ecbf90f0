"""ToolRegistry (plain functions as tools) and the ToolHostActor that serves it on the bus."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import pytest

from actors.app.wiring import registry
from actors.conversation import ToolExecution, ToolHostActor, ToolRegistry, ToolRegistryError
from actors.conversation.messages import BindSink, ExecuteTool, ListTools, ToolList
from actors.conversation.tools import describe_tools
from transport.node import Node


def weather(city: str, unit: Literal["C", "F"] = "C", days: int | None = None) -> str:
    """Today's weather for a city.

    Longer text that is still the description.

    Args:
        city: the city's name
        unit: the temperature unit,
            Celsius or Fahrenheit
        days: how many days ahead
    """
    return f"{city}: sunny, 21 {unit}"


def boom(x: float) -> str:
    """Always fails."""
    raise RuntimeError(f"exploded at {x}")


def listing(items: list[str], options: dict[str, Any], flag: bool = False) -> dict[str, Any]:
    return {"n": len(items), "flag": flag}


def test_schema_from_type_hints_and_docstring() -> None:
    tools = ToolRegistry()
    spec = tools.register(weather)
    assert spec.name == "weather"
    assert spec.description == "Today's weather for a city. Longer text that is still the description."
    assert spec.parameters == {
        "type": "object",
        "properties": {
            "city": {"type": "string", "description": "the city's name"},
            "unit": {"enum": ["C", "F"], "description": "the temperature unit, Celsius or Fahrenheit"},
            "days": {"type": "integer", "description": "how many days ahead"},
        },
        "required": ["city"],
    }
    other = tools.register(listing)
    assert other.description == ""
    assert other.parameters["properties"] == {
        "items": {"type": "array", "items": {"type": "string"}},
        "options": {"type": "object"},
        "flag": {"type": "boolean"},
    }
    assert tools.names() == ["weather", "listing"] and [s.name for s in tools.specs()] == tools.names()


def test_functions_that_cannot_be_tools_are_refused() -> None:
    tools = ToolRegistry()

    def star(*args: int) -> None:
        pass

    def odd(x: complex) -> None:
        pass

    for fn in (star, odd):
        with pytest.raises(ToolRegistryError):
            tools.register(fn)
    with pytest.raises(ToolRegistryError):
        tools.register(weather, name="bad name!")
    assert len(tools) == 0


def test_execute_reports_every_failure_as_a_result() -> None:
    tools = ToolRegistry()
    tools.register(weather)
    tools.register(boom)
    tools.register(listing)
    assert tools.execute("weather", {"city": "Oslo"}) == ToolExecution(ok=True, text="Oslo: sunny, 21 C")
    assert tools.execute("listing", {"items": ["a"], "options": {}}).text == '{"n": 1, "flag": false}'
    failures = {
        "unknown": tools.execute("nope", {}),
        "missing": tools.execute("weather", {}),
        "extra": tools.execute("weather", {"city": "x", "zip": 1}),
        "type": tools.execute("weather", {"city": 3}),
        "enum": tools.execute("weather", {"city": "x", "unit": "K"}),
        "raised": tools.execute("boom", {"x": 1.5}),
    }
    assert all(not f.ok for f in failures.values())
    assert "tools: boom, listing, weather" in failures["unknown"].text
    assert "missing argument(s) city" in failures["missing"].text
    assert failures["raised"].text == "RuntimeError: exploded at 1.5"


def test_registering_a_name_again_replaces_the_tool() -> None:
    """ES-04: one entry per name."""
    tools = ToolRegistry()
    tools.register(weather)
    tools.register(lambda city: "replaced", name="weather")
    assert len(tools) == 1 and tools.execute("weather", {"city": "x"}).text == "replaced"


def test_describe_tools_lists_the_registry_for_call_ktool() -> None:
    tools = ToolRegistry()
    tools.register(weather)
    text = describe_tools(tools.specs())
    assert '"name": <tool name>' in text
    assert "- weather(city: string, unit: any, days: integer): Today's weather" in text
    assert "No application tools" in describe_tools(())


def test_the_host_actor_survives_a_tool_that_raises(make_node: Callable[..., Node]) -> None:
    """A tool exception is the call's result; the host answers the next call."""
    node = make_node("n1", registry=registry())
    tools = ToolRegistry()
    tools.register(boom)
    tools.register(weather)
    node.spawn(ToolHostActor, "tools", registry=tools)
    failed = node.request("n1/tools", ExecuteTool(name="boom", arguments={"x": 2}), timeout=5)
    assert failed == ToolExecution(ok=False, text="RuntimeError: exploded at 2")
    ok = node.request("n1/tools", ExecuteTool(name="weather", arguments={"city": "Rome"}), timeout=5)
    assert ok.ok and ok.text.startswith("Rome")
    listed = node.request("n1/tools", ListTools(), timeout=5)
    assert isinstance(listed, ToolList) and [s.name for s in listed.specs] == ["boom", "weather"]
    node.request("n1/tools", BindSink(address="n1/somewhere"), timeout=5)
    assert tools.sink is not None
