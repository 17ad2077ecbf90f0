"""What both loops ask their application host, defined once: ``HostRecord``, ``HostExecuteTool`` and
``HostCompleteCapture``; and ``ToolHostActor``, the base of ``run_session``'s ``HostActor`` and the
subagent's ``RunHostActor``: each runs ``execute_tool`` at most once per idempotency key through the one
effect store (actors/effects.py), so a repeated call gets the recorded outcome instead of a second run.

The tags keep the ``rs.`` prefix they had as ``run_session``'s messages, so captures of session traffic stay
valid; the subagent's copies (``sa.host.record``, ``sa.host.execute_tool``, ``sa.host.complete_capture``)
are gone.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Final

from actors.base import BusActor, Context
from actors.effects import EffectRunner, EffectStore, RerunSafe, rerun_rule
from actors.runs.events import AnyRunEvent
from actors.runs.projection import ContextBudget
from actors.types import ToolCall, ToolCallError
from transport.codec import JsonValue
from transport.node import Node
from transport.records import frozen

__all__ = [
    "HANDLE_TIMEOUT",
    "HOST_TIMEOUT",
    "HostCompleteCapture",
    "HostExecuteTool",
    "HostRecord",
    "ToolHostActor",
]

HOST_TIMEOUT: Final = 3600.0  # a host call (a tool) may take long; the run's own deadline bounds the caller
HANDLE_TIMEOUT: Final = 3600.0


@frozen(kw_only=True)
class HostRecord:
    """Record one event of the run; the loop waits for the answer (EV-10)."""

    TAG: ClassVar[str] = "rs.host.record"
    event: AnyRunEvent


@frozen(kw_only=True)
class HostExecuteTool:
    """Run one tool call. ``idempotency_key``: the call's effect key (``idempotency_key(...)``), so a repeat
    never runs the tool twice; empty: unprotected. ``operation_id``: the turn's child operation (RS-11,
    SA-20). ``budget``: a subagent run's projection budget before this result (SA-20); ``None`` for a
    session. ``call`` is a ``ToolCallError`` only for a session (RS-11; a subagent answers those itself)."""

    TAG: ClassVar[str] = "rs.host.execute_tool"
    call: ToolCall | ToolCallError
    operation_id: uuid.UUID
    idempotency_key: str = ""
    call_id: str = ""
    budget: ContextBudget | None = None


@frozen(kw_only=True)
class HostCompleteCapture:
    """The turn's terminal answer for the designated capture (RS-21, SA-21; ``budget``: a subagent's)."""

    TAG: ClassVar[str] = "rs.host.complete_capture"
    capture: JsonValue
    contents: str
    budget: ContextBudget | None = None


class ToolHostActor(BusActor):
    """Serves an application host object on the bus; ``execute`` runs its tool through the effect store.

    ``effects`` names the SQLite file that keeps the outcomes across restarts; without it they are kept in
    memory. A key whose run was cut off (the host died while it ran) is answered with ``unknown(text)`` and
    not run again unless ``rerun_safe`` (tool names, or a predicate on the ``ToolCall``) says so; a store that
    cannot be written answers ``EffectStoreError`` and runs nothing."""

    def __init__(
        self,
        node: Node,
        address: str,
        *,
        unknown: Callable[[str], Any],
        effects: str | Path | None = None,
        rerun_safe: RerunSafe = (),
    ) -> None:
        super().__init__(node, address)
        self._effects = EffectRunner(self, EffectStore(effects), unknown)
        self._rerun_safe = rerun_rule(rerun_safe)

    def execute(
        self, ctx: Context, call: ToolCall | ToolCallError, key: str, start: Callable[[], Any]
    ) -> Any:
        """Answer ``ctx`` with the outcome of ``start()`` (running ``call``) under ``key``: the handler's
        return value (an answer now, or ``DEFER``)."""
        summary = f"tool {call.name[:80]!r}" if isinstance(call, ToolCall) else "an invalid tool call"
        return self._effects.execute(ctx, key, summary, start, rerun_safe=self._rerun_safe(call))

    def on_stop(self) -> None:
        self._effects.close()
        super().on_stop()
