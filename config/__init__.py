"""Typed node settings: frozen dataclasses loaded from TOML and KBUS_* environment variables."""

from config.settings import (
    DEFAULT_CONFIG,
    ActorSpec,
    AllowedClient,
    ConfigError,
    NodeSettings,
    PeerSettings,
    Rule,
    SecuritySettings,
    Settings,
    build,
    default_frame_bytes,
    frame_bytes_for,
    from_mapping,
    load,
    settings_for_node,
)

__all__ = [
    "DEFAULT_CONFIG",
    "ActorSpec",
    "AllowedClient",
    "ConfigError",
    "NodeSettings",
    "PeerSettings",
    "Rule",
    "SecuritySettings",
    "Settings",
    "build",
    "default_frame_bytes",
    "frame_bytes_for",
    "from_mapping",
    "load",
    "settings_for_node",
]
