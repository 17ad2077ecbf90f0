"""``ToolHostActor``: serves a ``ToolRegistry`` on the bus (the conversation's host placement).

Tools run on this actor's thread, one call at a time; a tool that raises gives ``ToolExecution(ok=False)``
and the actor lives on. It may run in another process than the conversation (``builder().host(address)``):
start it there with ``node.spawn(ToolHostActor, name, registry=registry, effects="tools.sqlite3")``.

Each ``ExecuteTool`` with an ``idempotency_key`` runs at most once per key (actors/effects.py): a repeat
gets the stored ``ToolExecution``; a key whose run was cut off (this host died while it ran) gets
``ToolExecution(ok=False, unknown=True)`` and is not run again, unless its tool was registered
``rerun_safe``; a store that cannot be written answers ``EffectStoreError`` and runs nothing. ``effects``
names the SQLite file that keeps this across restarts; without it the keys are remembered in memory.

It also holds the conversation's checkpoint binding (``BindCheckpoints``; checkpoints.py): the checkpoint
tools run here, next to the files they snapshot, and ``HostRestoreCheckpoint`` restores through it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from actors.base import BusActor, Context
from actors.conversation.checkpoints import CheckpointBinding, TouchedFiles, bind_checkpoints
from actors.conversation.messages import (
    BindCheckpoints,
    BindSink,
    CheckpointsBound,
    ConversationError,
    ExecuteTool,
    HostRestoreCheckpoint,
    ListTools,
    ToolList,
)
from actors.conversation.shadow import CheckpointError, ShadowRepo
from actors.conversation.sinks import RemoteSink
from actors.conversation.tools import ToolExecution, ToolRegistry
from actors.effects import EffectRunner, EffectStore
from transport.errors import ProtocolError
from transport.node import Node

__all__ = ["ToolHostActor"]


class ToolHostActor(BusActor):
    # Tools run on this thread and may never return: a daemon thread lets the process exit (after an explicit
    # stop has given up on a busy tool) instead of waiting on it forever.
    use_daemon_thread = True

    def __init__(
        self, node: Node, address: str, *, registry: ToolRegistry, effects: str | Path | None = None
    ) -> None:
        super().__init__(node, address)
        self.registry = registry
        self._effects = EffectRunner(self, EffectStore(effects), _unknown)
        self._checkpoints: CheckpointBinding | None = None

    def handle(self, message: Any, ctx: Context) -> Any:
        match message:
            case ExecuteTool(name=name, arguments=arguments, idempotency_key=key):
                registry = self.registry
                return self._effects.execute(
                    ctx,
                    key,
                    f"tool {name[:80]!r}",
                    lambda: registry.execute(name, arguments, call_key=key),
                    rerun_safe=registry.is_rerun_safe(name),
                )
            case ListTools():
                return ToolList(specs=self.registry.specs(), mutating=self.registry.mutating_names())
            case BindSink(address=address):
                sink = RemoteSink(self.node, address, src=self.address) if address is not None else None
                self.registry.bind_sink(sink)
                return None
            case BindCheckpoints():
                return self._bind_checkpoints(message)
            case HostRestoreCheckpoint(checkpoint_id=checkpoint_id):
                if self._checkpoints is None:
                    raise ConversationError("checkpoints are not enabled in this conversation")
                try:
                    return self._checkpoints.restore(checkpoint_id)
                except CheckpointError as exc:
                    raise ConversationError(f"restore: {exc}") from None
        raise ProtocolError(f"{self.address} does not handle {type(message).__name__}")

    def _bind_checkpoints(self, bind: BindCheckpoints) -> CheckpointsBound:
        touched = None
        if bind.touched_slot:
            touched = TouchedFiles.lookup(bind.touched_slot)
            if touched is None:
                raise ConversationError(
                    "enable_checkpoints: the TouchedFiles given is not in the tool host's process"
                )
        try:
            shadow = ShadowRepo.from_spec(bind.shadow)
            binding = bind_checkpoints(
                self.registry, shadow, bind.session_id, bind.log_path, touched, restore_tool=bind.restore_tool
            )
        except CheckpointError as exc:
            raise ConversationError(f"enable_checkpoints: {exc}") from None
        self._checkpoints = binding
        names = tuple(fn.__name__ for fn, _ in binding.tools(restore=bind.restore_tool))
        return CheckpointsBound(tools=names)

    def on_stop(self) -> None:
        self._effects.close()
        super().on_stop()


def _unknown(text: str) -> ToolExecution:
    return ToolExecution(ok=False, unknown=True, text=text)
