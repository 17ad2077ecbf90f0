"""The Codex adapter: one actor owning one ``codex app-server`` child (RULES.md §1-2, Appendix C.2).

Public API: ``Adapter`` / ``Turn`` (facades, ``actors.codex.adapter``) and the value types of
``actors.codex.types``.
"""

from actors.codex.types import (
    ASYNC_TOOL_ACKNOWLEDGEMENT,
    AdapterConfig,
    AdapterError,
    CodexToolCall,
    Done,
    DynamicTool,
    ErrorEvent,
    ErrorKind,
    Event,
    TextDelta,
    ToolCallEvent,
    ToolResult,
)

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
]
