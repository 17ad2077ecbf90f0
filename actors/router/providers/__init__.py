"""Provider clients behind the Router: local (llama.cpp, the embedded default), openai, codex, scripted."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING as _TYPE_CHECKING

from actors.router.providers.base import Provider

if _TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any


class ProviderConfigError(ValueError):
    """A provider entry that cannot be built (missing credential variable, unknown kind)."""


def build_provider(entry: Any, *, env: Mapping[str, str] | None = None) -> Provider:
    """The client for one ``[providers.NAME]`` entry. Credentials come from the environment variable the
    entry names, read here inside the Router and nowhere else."""
    env = os.environ if env is None else env
    options = dict(entry.options)
    kind = entry.kind
    if kind == "scripted":
        from actors.router.providers.scripted import ScriptedProvider

        return ScriptedProvider.from_options(options)
    if kind == "local":
        from actors.router.providers.local import LocalProvider

        return LocalProvider(**options)
    if kind == "openai":
        from actors.router.providers.openai_compat import OpenAIProvider

        key_var = options.pop("api_key_env", None)
        api_key = env.get(key_var) if key_var else None
        if key_var and not api_key:
            raise ProviderConfigError(f"provider {entry.name}: environment variable {key_var} is not set")
        return OpenAIProvider(api_key=api_key or "not-needed", **options)
    if kind == "codex":
        from actors.router.providers.codex import CodexProvider

        return CodexProvider(**options)
    raise ProviderConfigError(f"provider {entry.name}: unknown kind {kind!r}")


__all__ = ["Provider", "ProviderConfigError", "build_provider"]
