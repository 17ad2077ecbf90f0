"""Public value types of the Codex adapter (RULES.md AD-01..03, Appendix C.2 ``kcode/codex_adapter``).

Every type here travels on the bus: frozen dataclasses with written-out tags, and ``AdapterError`` is a
``BusError`` so it is raised again as the same class on the far side of a request.

Two departures from C.2, both forced by the wire and kept call-compatible:

- ``AdapterConfig.executable`` is stored as ``str`` (the codec has no ``Path``); a ``Path`` is accepted and
  converted, so ``AdapterConfig(executable=Path(...), ...)`` works.
- ``ErrorEvent`` stores the error's ``kind``/``message``/``diagnostics`` (an exception is not a wire value).
  ``ErrorEvent(error)`` still constructs it, ``event.error`` returns the ``AdapterError`` and
  ``case ErrorEvent(error=e)`` / ``case ErrorEvent(e)`` match it.
"""

from __future__ import annotations

import enum
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Final, TypeAlias

from actors.errors import Broken
from actors.types import ToolResult
from transport.codec import JsonValue
from transport.errors import BusError
from transport.records import frozen

# SH-01: byte for byte the seed's constant.
ASYNC_TOOL_ACKNOWLEDGEMENT: Final[str] = (
    "The tool was launched asynchronously. Its result will not be available during this turn. "
    "Do not wait for or poll this call; continue the turn without its result. "
    "The result will be provided in the next user turn."
)


class ErrorKind(enum.StrEnum):
    """AD-02: exactly the seed's error kinds."""

    BUSY = "busy"
    INTERRUPTED = "interrupted"
    INVALID_TOOL_RESULT = "invalid_tool_result"
    LAUNCH_REJECTED = "launch_rejected"
    PROTOCOL = "protocol"
    SERVER = "server"
    UNAVAILABLE = "unavailable"


class AdapterError(Broken):
    """AD-02: ``kind``, ``message`` and the child's stderr snapshot ``diagnostics``; equal by all three."""

    WIRE = "codex.adapter"

    def __init__(self, kind: ErrorKind | str, message: str = "", diagnostics: bytes = b"") -> None:
        super().__init__(message)
        self.kind = ErrorKind(kind)
        self.diagnostics = bytes(diagnostics)

    def wire_fields(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "diagnostics": self.diagnostics}

    @classmethod
    def from_wire(cls, message: str, fields: Mapping[str, Any]) -> BusError:
        diagnostics = fields.get("diagnostics", b"")
        if not isinstance(diagnostics, bytes):
            raise ValueError("diagnostics is not bytes")
        return cls(ErrorKind(fields["kind"]), message, diagnostics)

    def __str__(self) -> str:
        return f"{self.kind.value}: {self.message}"

    def __repr__(self) -> str:
        return f"AdapterError({self.kind.name}, {self.message!r}, <{len(self.diagnostics)} bytes>)"

    def __hash__(self) -> int:
        return hash((self.kind, self.message, self.diagnostics))

    def __reduce__(self) -> Any:
        return (type(self), (self.kind, self.message, self.diagnostics))


@frozen(kw_only=True)
class DynamicTool:
    """A client-side tool declared on the app-server thread (``dynamicTools``)."""

    TAG: ClassVar[str] = "codex.dynamic_tool"
    name: str
    description: str
    input_schema: JsonValue


@frozen(kw_only=True)
class AdapterConfig:
    """AD-01. ``executable`` may be given as a ``Path``; it is kept as ``str`` (see the module doc)."""

    TAG: ClassVar[str] = "codex.config"
    executable: str
    working_directory: str
    model: str
    reasoning_effort: str | None = None
    base_instructions: str = ""
    tools: tuple[DynamicTool, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.executable, os.PathLike):
            object.__setattr__(self, "executable", os.fspath(self.executable))
        tools: Any = self.tools
        if not isinstance(tools, tuple):
            object.__setattr__(self, "tools", tuple(tools))


@frozen(kw_only=True)
class CodexToolCall:
    """AD-03 / TU-09: the provider's call id, tool name and parsed JSON arguments, exactly as sent."""

    TAG: ClassVar[str] = "codex.tool_call"
    call_id: str
    name: str
    arguments: JsonValue


@frozen
class TextDelta:
    TAG: ClassVar[str] = "codex.ev.text"
    text: str


@frozen
class ToolCallEvent:
    TAG: ClassVar[str] = "codex.ev.tool_call"
    call: CodexToolCall


@frozen
class Done:
    TAG: ClassVar[str] = "codex.ev.done"


@dataclass(frozen=True, slots=True, init=False, match_args=False)
class ErrorEvent:
    """The terminal error of a turn. ``ErrorEvent(error)``; ``.error`` is the ``AdapterError``."""

    TAG: ClassVar[str] = "codex.ev.error"
    __match_args__: ClassVar[tuple[str, ...]] = ("error",)
    kind: ErrorKind
    message: str
    diagnostics: bytes

    def __init__(
        self,
        error: AdapterError | None = None,
        *,
        kind: ErrorKind | str | None = None,
        message: str = "",
        diagnostics: bytes = b"",
    ) -> None:
        if error is not None:
            if kind is not None:
                raise TypeError("ErrorEvent takes an AdapterError or kind/message/diagnostics, not both")
            kind, message, diagnostics = error.kind, error.message, error.diagnostics
        if kind is None:
            raise TypeError("ErrorEvent needs an AdapterError or a kind")
        object.__setattr__(self, "kind", ErrorKind(kind))
        object.__setattr__(self, "message", message)
        object.__setattr__(self, "diagnostics", bytes(diagnostics))

    @property
    def error(self) -> AdapterError:
        return AdapterError(self.kind, self.message, self.diagnostics)

    def __repr__(self) -> str:
        return f"ErrorEvent({self.kind.name}, {self.message!r})"


Event: TypeAlias = TextDelta | ToolCallEvent | Done | ErrorEvent


TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]+")
"""What codex accepts as a dynamic tool's name (``^[a-zA-Z0-9_-]+$``)."""


def validate_config(config: AdapterConfig) -> None:
    """AD-06/AD-07: reject an invalid config (one linear pass); ``UNAVAILABLE`` naming the field."""

    def bad(field: str, why: str) -> AdapterError:
        return AdapterError(ErrorKind.UNAVAILABLE, f"invalid AdapterConfig.{field}: {why}")

    if not isinstance(config, AdapterConfig):
        raise AdapterError(ErrorKind.UNAVAILABLE, f"not an AdapterConfig: {type(config).__name__}")
    if not config.executable:
        raise bad("executable", "empty")
    if not config.model:
        raise bad("model", "empty")
    if config.reasoning_effort is not None and config.reasoning_effort == "":
        raise bad("reasoning_effort", "empty string (use None for the default)")
    if not config.working_directory:
        raise bad("working_directory", "empty")
    seen: set[str] = set()
    for i, tool in enumerate(config.tools):
        if not isinstance(tool, DynamicTool):
            raise bad(f"tools[{i}]", f"not a DynamicTool: {type(tool).__name__}")
        if not tool.name:
            raise bad(f"tools[{i}].name", "empty")
        if not TOOL_NAME.fullmatch(tool.name):
            # codex refuses the thread over such a name, and then every start_turn fails with SERVER
            raise bad(f"tools[{i}].name", f"{tool.name[:80]!r} is not letters, digits, '_' and '-' only")
        if tool.name in seen:
            raise bad(f"tools[{i}].name", f"duplicate tool name {tool.name[:80]!r}")
        seen.add(tool.name)
        if not isinstance(tool.input_schema, dict):
            raise bad(f"tools[{i}].input_schema", "not a JSON object")


CODEX_TYPES = (DynamicTool, AdapterConfig, CodexToolCall, TextDelta, ToolCallEvent, Done, ErrorEvent)
CODEX_TYPE_ERRORS: tuple[type[BusError], ...] = (AdapterError,)

__all__ = [
    "ASYNC_TOOL_ACKNOWLEDGEMENT",
    "AdapterConfig",
    "AdapterError",
    "CodexToolCall",
    "Done",
    "DynamicTool",
    "ErrorEvent",
    "ErrorKind",
    "Event",
    "TextDelta",
    "ToolCallEvent",
    "ToolResult",
    "validate_config",
]
