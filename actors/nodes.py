"""Build a running node from settings: the registry of every message kbus speaks and the actor types."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from actors.echo import EchoActor
from config import ConfigError, Settings
from transport.capture import CaptureWriter
from transport.codec import Registry
from transport.messages import SYSTEM_MESSAGES
from transport.node import Node

# Actor types a config file may name in [actors.<name>] type = "...". Explicit, like the message table.
ACTOR_TYPES: Mapping[str, Callable[..., Any]] = {
    "echo": EchoActor,
}


def registry(max_body_bytes: int = 1 << 20) -> Registry:
    """Every message class kbus puts on the wire (later layers add their tuples here)."""
    return Registry(SYSTEM_MESSAGES, max_body_bytes=max_body_bytes)


def build_node(settings: Settings, *, capture: str | Path | None = None) -> Node:
    """Start the node the settings describe and spawn its actors; stops the node again on any failure."""
    reg = registry(settings.node.max_frame_bytes)
    for spec in settings.actors:
        if spec.type not in ACTOR_TYPES:
            raise ConfigError(settings.source, f"actors.{spec.name}.type",
                              f"one of {sorted(ACTOR_TYPES)}", spec.type)
    writer = CaptureWriter(capture, node=settings.node.name, schema=reg.schema_hash()) if capture else None
    node = Node.from_settings(settings, registry=reg, **({"capture": writer} if writer else {}))
    node.start()
    try:
        for spec in settings.actors:
            node.spawn(ACTOR_TYPES[spec.type], spec.name, **dict(spec.options))
    except BaseException:
        node.stop()
        raise
    return node
