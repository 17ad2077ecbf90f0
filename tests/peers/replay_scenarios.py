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


def conversation(model: str, router: str = "n1/router", name: str = "n1/agent", **config: Any) -> Factory:
    """The conversation actor with the config the builder gave it when recorded (``config``: e.g. the
    loops' ``judge_timeout``, ``plan_mode``)."""
    from actors.conversation.actor import ConversationActor

    return Factory(
        ConversationActor,
        config=ConversationConfig(router=router, model=model, host=f"{name}.host", **config),
    )


def tool_host(registry: ToolRegistry | None = None) -> Factory:
    return Factory(ToolHostActor, registry=registry if registry is not None else tools())


# ------------------------------------------------------------------- the loops' and gates' captures
# Each runs on the scripted model (the Router's provider events are recorded, so a replay needs none).
SCRIPTED = ModelCatalog.from_mapping(
    {
        "providers": {"p1": {"kind": "scripted"}},
        "models": {
            "m1": {
                "provider": "p1",
                "provider_model": "p1",
                "context_window": 32768,
                "max_input_tokens": 30000,
            }
        },
    }
)
GOAL = ("write hello.txt", "hello.txt has text")
JUDGE_TIMEOUT = 30.0
WAKE_SLOT = "wake"
WAKE_DELAY = 0.2  # a short real delay when recording; the replay serves the firing from the log
PLAN_TEXT = "1. write the note\n2. say done"


JOB_ID = "job-1"
JOB_COMMAND = "echo hello; exit 3"


def _call(name: str, call_id: str, **arguments: Any) -> dict[str, Any]:
    return {"call": {"name": name, "arguments": arguments}, "id": call_id}


def _verdict(call_id: str, achieved: bool, reason: str) -> dict[str, Any]:
    return _call("goal_verdict", call_id, achieved=achieved, reason=reason, impossible=False)


# The model's turns of each scenario, in order (judge calls included).
GOAL_SCRIPTS = [
    [{"text": "I created hello.txt"}],
    [_verdict("v1", False, "the file is empty")],
    [{"text": "hello.txt now says hi"}],
    [_verdict("v2", True, "the file has text")],
]
WAKE_SCRIPTS = [
    [_call("schedule_wakeup", "w1", delay_seconds=WAKE_DELAY, prompt="check the build"), {"text": "later"}],
    [{"text": "the build is green"}],
]
PLAN_SCRIPTS = [
    [
        _call("exit_plan_mode", "p1", plan=PLAN_TEXT),
        _call("write_note", "n1", text="hello"),
        {"text": "done"},
    ]
]


class Notes:
    """The mutating tool of the approved-plan capture: it may run only once the plan is approved."""

    def __init__(self) -> None:
        self.written: list[str] = []

    def write_note(self, text: str) -> str:
        """Write a note (changes state: denied in plan mode)."""
        self.written.append(text)
        return f"wrote {text!r}"


def plan_tools(notes: Notes | None = None) -> ToolRegistry:
    from actors.conversation.people import register_people_tools

    registry = ToolRegistry()
    registry.register((notes or Notes()).write_note, name="write_note", mutating=True)
    register_people_tools(registry)
    return registry


def gate() -> Factory:
    from actors.conversation.kernel import HOST_TIMEOUT
    from actors.conversation.people import GateActor

    return Factory(GateActor, conversation="n1/agent", kind="plan", timeout=HOST_TIMEOUT)


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
    providers = {"local": never, "scripted": never, "lab": never, "p1": never}
    return Factory(RouterActor, catalog=catalog, providers=providers)


def turn_workers() -> list[str]:
    """The Router's provider worker threads alive now."""
    return [t.name for t in threading.enumerate() if t.name.startswith("kbus-turn-")]


# What `kbus log replay --class peers.replay_scenarios:CONVERSATION` replays the committed conversation as.
CONVERSATION = conversation("smollm2")
