"""Build a running node from settings: the registry of every message kbus speaks and the actor types."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from actors.app.echo import EchoActor
from actors.base import HostPool
from actors.codex.messages import CODEX_ERRORS, CODEX_MESSAGES
from actors.conversation import CONVERSATION_ERRORS, CONVERSATION_MESSAGES
from actors.conversation.kernel import CONVERSATION_HOSTS, TOOL_HOSTS
from actors.effects import EFFECT_ERRORS
from actors.inference.handle import INFERENCE_ERRORS, INFERENCE_MESSAGES
from actors.router.actor import RouterActor
from actors.router.catalog import ModelCatalog, UnknownModel
from actors.router.messages import ROUTER_ERRORS, ROUTER_MESSAGES
from actors.runs.session import SESSION_ERRORS, SESSION_MESSAGES
from actors.runs.subagent import SUBAGENT_ERRORS, SUBAGENT_MESSAGES
from actors.types import AGENT_TYPES
from config import ConfigError, Settings
from transport.capture import CaptureWriter
from transport.codec import Registry
from transport.errors import ErrorRegistry
from transport.messages import SYSTEM_MESSAGES
from transport.node import Node


def _router(settings: Settings) -> Callable[..., Any]:
    catalog = ModelCatalog.from_settings(settings)

    def start(node: Node, address: str, **options: Any) -> Any:
        return RouterActor.start(
            node,
            address,
            catalog=catalog,
            data_dir=options.pop("data_dir", settings.node.data_dir),
            **options,
        )

    return start


# Actor types a config file may name in [actors.<name>] type = "...". Explicit, like the message table.
ACTOR_TYPES: Mapping[str, Callable[[Settings], Callable[..., Any]]] = {
    "echo": lambda settings: EchoActor.start,
    "router": _router,
}

MESSAGES = (*SYSTEM_MESSAGES, *AGENT_TYPES, *ROUTER_MESSAGES, *INFERENCE_MESSAGES, *SESSION_MESSAGES)
MESSAGES = (*MESSAGES, *SUBAGENT_MESSAGES, *CODEX_MESSAGES, *CONVERSATION_MESSAGES)
ERRORS = (*ROUTER_ERRORS, UnknownModel, *INFERENCE_ERRORS, *SESSION_ERRORS)
ERRORS = (*ERRORS, *SUBAGENT_ERRORS, *CODEX_ERRORS, *CONVERSATION_ERRORS, *EFFECT_ERRORS)


def registry(max_body_bytes: int = 1 << 20) -> Registry:
    """Every message class and error class kbus puts on the wire."""
    return Registry(MESSAGES, ErrorRegistry().extended(ERRORS), max_body_bytes=max_body_bytes)


class _Starter:
    """Adapts a start function to ``Node.spawn``'s ``actor_class.start(node, address, ...)`` call."""

    def __init__(self, start: Callable[..., Any]) -> None:
        self.start = start


def build_node(settings: Settings, *, capture: str | Path | None = None) -> Node:
    """Start the node the settings describe and spawn its actors; stops the node again on any failure."""
    reg = registry(settings.node.max_frame_bytes)
    for spec in settings.actors:
        if spec.type not in ACTOR_TYPES:
            raise ConfigError(
                settings.source, f"actors.{spec.name}.type", f"one of {sorted(ACTOR_TYPES)}", spec.type
            )
    starters = {spec.name: _Starter(ACTOR_TYPES[spec.type](settings)) for spec in settings.actors}
    writer = CaptureWriter(capture, node=settings.node.name, schema=reg.schema_hash()) if capture else None
    node = Node.from_settings(settings, registry=reg, **({"capture": writer} if writer else {}))
    HostPool.configure(node, CONVERSATION_HOSTS, settings.node.hosts)
    HostPool.configure(node, TOOL_HOSTS, settings.node.tool_hosts)
    node.start()
    try:
        for spec in settings.actors:
            node.spawn(starters[spec.name], spec.name, **dict(spec.options))
    except BaseException:
        node.stop()
        raise
    return node
