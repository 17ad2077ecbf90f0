"""Plain Python functions as tools: ``ToolRegistry.register(fn)`` derives the JSON schema from the type hints
and the docstring; ``execute`` runs one call and always answers ``ToolExecution(ok, text)`` (a tool that
raises gives ``ok=False`` with the error's text, never an exception out of the registry).

A tool with a parameter named ``sink`` (annotated ``EventSink``) holds the session's event sink: the
parameter is not shown to the model; the registry injects the sink it was last bound to
(``bind_sink``), which is how ``set_event_sink`` reaches such tools (ES-02) and ``replace_event_sink`` does
not (ES-03).
"""

from __future__ import annotations

import inspect
import json
import re
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Literal, Protocol, get_args, get_origin, get_type_hints

from actors.types import OfferedTool
from transport.codec import JsonValue
from transport.records import frozen

__all__ = [
    "EventSinkLike",
    "ToolExecution",
    "ToolRegistry",
    "ToolRegistryError",
    "ToolSpec",
    "describe_tools",
    "offered_tools",
]

SINK_PARAMETER = "sink"
KEY_PARAMETER = (
    "call_key"  # a tool with this parameter gets the call's idempotency key (not shown to the model)
)
MAX_RESULT_CHARS = 16_000
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")


class EventSinkLike(Protocol):
    def emit(self, event: Any) -> None: ...


class ToolRegistryError(ValueError):
    """A function that cannot be a tool (no usable name, unsupported parameter kind)."""


@frozen(kw_only=True)
class ToolSpec:
    """What the model is told about one tool: its name, description and JSON-schema parameters; and
    ``mutating``, the flag it was registered with (the model is not told it: plan mode denies such a tool)."""

    TAG: ClassVar[str] = "conv.tool_spec"
    name: str
    description: str
    parameters: JsonValue
    mutating: bool = False


@frozen(kw_only=True)
class ToolExecution:
    """One tool call's result: ``ok`` False for an unknown tool, bad arguments or a tool that raised.

    ``unknown`` True: the call may or may not have run (its host died while it ran, or the host could not
    be reached after the request left); ``ok`` is then False and ``text`` says so. Such a call is never run
    again by its idempotency key unless its tool was registered ``rerun_safe``.
    """

    TAG: ClassVar[str] = "conv.tool_execution"
    ok: bool
    text: str
    unknown: bool = False


@frozen
class _Tool:
    spec: ToolSpec
    fn: Callable[..., Any]
    params: tuple[str, ...]
    required: frozenset[str]
    wants_sink: bool
    wants_key: bool = False
    mutating: bool = False  # changes something outside the conversation (plan mode, permission hooks)
    rerun_safe: bool = False  # may run again for a key whose earlier run's outcome is unknown


def _schema(hint: Any) -> dict[str, Any]:
    if hint is inspect.Parameter.empty or hint is Any:
        return {}
    origin = get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        options = [a for a in get_args(hint) if a is not type(None)]
        return _schema(options[0]) if len(options) == 1 else {"anyOf": [_schema(a) for a in options]}
    if origin is Literal:
        values = list(get_args(hint))
        return {"enum": values}
    if hint is str:
        return {"type": "string"}
    if hint is bool:
        return {"type": "boolean"}
    if hint is int:
        return {"type": "integer"}
    if hint is float:
        return {"type": "number"}
    if hint is list or origin is list or origin is tuple:
        args = get_args(hint)
        return {"type": "array", **({"items": _schema(args[0])} if args else {})}
    if hint is dict or origin is dict:
        return {"type": "object"}
    raise ToolRegistryError(f"unsupported parameter type {hint!r}")


def _doc(fn: Callable[..., Any]) -> tuple[str, dict[str, str]]:
    """The description (the docstring up to an ``Args:`` section) and per-parameter descriptions."""
    doc = inspect.getdoc(fn) or ""
    head, _, args = doc.partition("\nArgs:")
    params: dict[str, str] = {}
    current: str | None = None
    for line in args.splitlines():
        match = re.match(r"^\s+(\w+)(?:\s*\([^)]*\))?:\s*(.*)$", line)
        if match:
            current = match.group(1)
            params[current] = match.group(2).strip()
        elif current and line.strip():
            params[current] = f"{params[current]} {line.strip()}"
        elif not line.strip():
            current = None
    return " ".join(head.split()), params


def _check(value: Any, schema: Mapping[str, Any]) -> bool:
    kind = schema.get("type")
    if "enum" in schema:
        return value in schema["enum"]
    if "anyOf" in schema:
        return any(_check(value, s) for s in schema["anyOf"])
    match kind:
        case "string":
            return isinstance(value, str)
        case "boolean":
            return isinstance(value, bool)
        case "integer":
            return isinstance(value, int) and not isinstance(value, bool)
        case "number":
            return isinstance(value, int | float) and not isinstance(value, bool)
        case "array":
            return isinstance(value, list | tuple)
        case "object":
            return isinstance(value, dict)
    return True


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        text = value
    else:
        try:
            text = json.dumps(value, ensure_ascii=False, default=str)
        except (TypeError, ValueError):
            text = repr(value)
    return text if len(text) <= MAX_RESULT_CHARS else text[:MAX_RESULT_CHARS] + "…[truncated]"


class ToolRegistry:
    """Named tools from plain functions. Not thread-safe: it lives inside one host actor once built."""

    def __init__(self) -> None:
        self._tools: dict[str, _Tool] = {}
        self._sink: EventSinkLike | None = None

    def register(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        mutating: bool = False,
        rerun_safe: bool = False,
    ) -> ToolSpec:
        """Add ``fn`` as a tool (replacing a tool of the same name, ES-04) and return its spec.

        ``mutating``: the tool changes files or the world (plan mode denies it; the permission layer may
        ask). ``rerun_safe``: running it twice does no harm, so a call whose earlier outcome is unknown (its
        host died mid-run) may run again under the same idempotency key instead of answering "unknown".
        """
        tool_name: str = name or str(getattr(fn, "__name__", ""))
        if not _NAME.match(tool_name):
            raise ToolRegistryError(f"{tool_name!r} is not a usable tool name")
        try:
            hints = get_type_hints(fn)
        except Exception as exc:
            raise ToolRegistryError(f"{tool_name}: cannot read type hints: {exc}") from exc
        summary, param_docs = _doc(fn)
        properties: dict[str, Any] = {}
        required: list[str] = []
        params: list[str] = []
        wants_sink = wants_key = False
        for p in inspect.signature(fn).parameters.values():
            if p.name == SINK_PARAMETER:
                wants_sink = True
                continue
            if p.name == KEY_PARAMETER:
                wants_key = True
                continue
            if p.kind not in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
                raise ToolRegistryError(f"{tool_name}: parameter {p.name} must be a named parameter")
            schema = _schema(hints.get(p.name, inspect.Parameter.empty))
            if p.name in param_docs:
                schema["description"] = param_docs[p.name]
            properties[p.name] = schema
            params.append(p.name)
            if p.default is inspect.Parameter.empty:
                required.append(p.name)
        spec = ToolSpec(
            name=tool_name,
            description=description if description is not None else summary,
            parameters={"type": "object", "properties": properties, "required": required},
            mutating=mutating,
        )
        self._tools[tool_name] = _Tool(
            spec,
            fn,
            tuple(params),
            frozenset(required),
            wants_sink,
            wants_key,
            mutating=mutating,
            rerun_safe=rerun_safe,
        )
        return spec

    def unregister(self, name: str) -> bool:
        """Remove the tool ``name``; False if there was none."""
        return self._tools.pop(name, None) is not None

    def is_mutating(self, name: str) -> bool:
        tool = self._tools.get(name)
        return tool is not None and tool.mutating

    def is_rerun_safe(self, name: str) -> bool:
        """An unknown tool is rerun-safe: running it only answers "unknown tool" again."""
        tool = self._tools.get(name)
        return tool is None or tool.rerun_safe

    def names(self) -> list[str]:
        return list(self._tools)

    def specs(self) -> tuple[ToolSpec, ...]:
        return tuple(t.spec for t in self._tools.values())

    def __len__(self) -> int:
        return len(self._tools)

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def bind_sink(self, sink: EventSinkLike | None) -> None:
        """Re-register the sink-holding tools with ``sink`` (ES-02): later calls emit to it."""
        self._sink = sink

    @property
    def sink(self) -> EventSinkLike | None:
        return self._sink

    def mutating_names(self) -> tuple[str, ...]:
        return tuple(n for n, t in self._tools.items() if t.mutating)

    def execute(self, name: str, arguments: Mapping[str, Any] | None, *, call_key: str = "") -> ToolExecution:
        """Run one call. Never raises for the tool's sake: every failure is ``ok=False`` with its reason.
        ``call_key`` (the call's idempotency key) is passed to a tool with a ``call_key`` parameter."""
        tool = self._tools.get(name)
        if tool is None:
            known = ", ".join(sorted(self._tools)) or "none"
            return ToolExecution(ok=False, text=f"unknown tool {name[:80]!r} (tools: {known})")
        args = dict(arguments or {})
        unknown = sorted(set(args) - set(tool.params))
        if unknown:
            return ToolExecution(ok=False, text=f"{name}: unknown argument(s) {', '.join(unknown)}")
        missing = sorted(tool.required - set(args))
        if missing:
            return ToolExecution(ok=False, text=f"{name}: missing argument(s) {', '.join(missing)}")
        props = tool.spec.parameters["properties"]
        for key, value in args.items():
            if not _check(value, props[key]):
                return ToolExecution(ok=False, text=f"{name}: argument {key} has the wrong type")
        if tool.wants_sink:
            args[SINK_PARAMETER] = self._sink
        if tool.wants_key:
            args[KEY_PARAMETER] = call_key
        try:
            value = tool.fn(**args)
        except Exception as exc:  # noqa: BLE001 - a tool's failure is its result, never the host's death
            return ToolExecution(ok=False, text=f"{type(exc).__name__}: {exc}"[:MAX_RESULT_CHARS])
        return ToolExecution(ok=True, text=_text(value))


def describe_tools(specs: tuple[ToolSpec, ...]) -> str:
    """The ``call_ktool`` description that lists the registry's tools (PreparedRound.tool_description)."""
    if not specs:
        return "No application tools are available in this conversation."
    lines = [
        'Run one application tool. Call with {"name": <tool name>, "arguments": {<the tool\'s arguments>}}.',
        "Available tools:",
    ]
    for spec in specs:
        props = spec.parameters.get("properties", {}) if isinstance(spec.parameters, dict) else {}
        args = ", ".join(f"{k}: {v.get('type', 'any')}" for k, v in props.items())
        lines.append(f"- {spec.name}({args}): {spec.description}".rstrip(": "))
    return "\n".join(lines)


def offered_tools(specs: tuple[ToolSpec, ...]) -> tuple[OfferedTool, ...]:
    """The tools ``describe_tools`` lists, as the structured list a turn carries (PreparedRound.tools)."""
    return tuple(
        OfferedTool(
            name=spec.name,
            description=spec.description,
            parameters=dict(spec.parameters) if isinstance(spec.parameters, dict) else {},
        )
        for spec in specs
    )
