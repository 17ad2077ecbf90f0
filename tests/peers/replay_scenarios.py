"""What scripts/record-replays records with and tests/replay/test_captures.py replays with: the tools, the
model catalogs and the actor factories of the conversation and Router captures (issue 17)."""

from __future__ import annotations

import threading
from typing import Any

from actors.conversation import ToolRegistry
from actors.conversation.host import ToolHostActor
from actors.conversation.kernel import ConversationConfig
from actors.router.actor import RouterActor
from actors.router.catalog import ModelCatalog

PROMPT = (
    'What is 1234 * 5678? Call call_ktool with {"name": "multiply", "arguments": {"a": 1234, "b": 5678}} '
    "and answer with the result."
)
LAB_PROMPT = "Say hello in one short sentence."
LAB_KEY_ENV = "KBUS_TEST_LAB_KEY"


def multiply(a: int, b: int) -> str:
    """Multiply two integers."""
    return str(a * b)


def tools() -> ToolRegistry:
    registry = ToolRegistry()
    registry.register(multiply)
    return registry


def lab_catalog(base_url: str) -> ModelCatalog:
    """The model 'smol' on an OpenAI-compatible server (a real llama_cpp.server when recording)."""
    return ModelCatalog.from_mapping(
        {
            "providers": {
                "lab": {
                    "kind": "openai",
                    "base_url": base_url,
                    "api_key_env": LAB_KEY_ENV,
                    "temperature": 0.0,
                    "seed": 7,
                    "max_attempts": 1,
                    "tool_choice": "none",
                }
            },
            "models": {
                "smol": {
                    "provider": "lab",
                    "provider_model": "SmolLM2-135M-Instruct",
                    "context_window": 2048,
                    "max_input_tokens": 1536,
                }
            },
        }
    )


class Factory:
    """An actor class with the options it was recorded with (``Replay.run`` calls ``start``)."""

    def __init__(self, cls: Any, **options: Any) -> None:
        self.cls = cls
        self.options = options

    def start(self, node: Any, address: str) -> Any:
        return self.cls.start(node, address, **self.options)


def conversation(model: str, router: str = "n1/router", name: str = "n1/agent") -> Factory:
    from actors.conversation.actor import ConversationActor

    return Factory(
        ConversationActor, config=ConversationConfig(router=router, model=model, host=f"{name}.host")
    )


def tool_host() -> Factory:
    return Factory(ToolHostActor, registry=tools())


class NeverCalled:
    """A provider a replayed Router must never run (its events come from the log): a worker that did would
    stay blocked here, alive, under its ``kbus-turn-`` thread name, for a test to find."""

    name = "never-called"

    def run_turn(self, request: Any, io: Any) -> Any:
        threading.Event().wait(60)
        raise AssertionError("a replayed Router ran a provider")

    def close(self) -> None:
        return None


def router(catalog: ModelCatalog | None = None) -> Factory:
    # Each provider the catalogs name is one a replayed Router must never run.
    never = NeverCalled()
    return Factory(RouterActor, catalog=catalog, providers={"local": never, "scripted": never, "lab": never})


def turn_workers() -> list[str]:
    """The Router's provider worker threads alive now."""
    return [t.name for t in threading.enumerate() if t.name.startswith("kbus-turn-")]


# What `kbus log replay --class peers.replay_scenarios:CONVERSATION` replays the committed conversation as.
CONVERSATION = conversation("smollm2")
