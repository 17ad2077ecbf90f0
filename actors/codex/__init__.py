"""The Codex adapter: one actor owning one ``codex app-server`` child, and the Shim on top (RULES.md §1-2,
Appendix C).

Layout, by concept (each module's docstring says what it holds):

    types.py      the seed's value types and ``AdapterError`` (wire values)
    messages.py   the adapter actor's wire messages, and ``codex_registry`` (a codex-only node's table)
    child.py      the child process: argv, model catalog, CODEX_HOME, stdio threads (``LaunchOptions``)
    rpc.py        JSON-RPC with the child: frame parsing, line encoding, request ids and continuations
    lifecycle.py  the child's life as frozen states and one ``step`` table
    actor.py      ``CodexAdapterActor``: the turn registry and the mapping of Codex frames onto turns
    facade.py     ``Adapter`` / ``Turn``: blocking and future facades, from any thread of any process
    shim.py       the Shim: one actor per conversation key that launches tool calls asynchronously
    binary.py     where the native codex binary is;  homes.py  private CODEX_HOME folders

This package imports only the shared bases (``actors.base``, ``actors.types``) and ``transport``: never the
Router or the application's wiring.
"""

from actors.codex.actor import CodexAdapterActor
from actors.codex.binary import find_codex
from actors.codex.child import LaunchOptions
from actors.codex.facade import Adapter, Turn
from actors.codex.messages import CODEX_ERRORS, CODEX_MESSAGES, codex_registry
from actors.codex.shim import (
    BoxCodec,
    LaunchRejected,
    Shim,
    ShimBox,
    ShimOutput,
    ShimText,
    ToolCallLauncher,
)
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
    "CODEX_ERRORS",
    "CODEX_MESSAGES",
    "Adapter",
    "AdapterConfig",
    "AdapterError",
    "BoxCodec",
    "CodexAdapterActor",
    "CodexToolCall",
    "Done",
    "DynamicTool",
    "ErrorEvent",
    "ErrorKind",
    "Event",
    "LaunchOptions",
    "LaunchRejected",
    "Shim",
    "ShimBox",
    "ShimOutput",
    "ShimText",
    "TextDelta",
    "ToolCallEvent",
    "ToolCallLauncher",
    "ToolResult",
    "Turn",
    "codex_registry",
    "find_codex",
]
