#!/usr/bin/env python3
"""One node running every actor type kbus has, in its own process, for the fuzzer (tests/peers/fuzz.py).

Actors: ``echo``, ``router`` (the scripted model only), ``chat`` (a conversation, with its tool host
``chat.host``), ``sessions`` (the session-loop service), ``host`` (a subagent ``RunHostActor``) and, with
``--codex``, ``codex`` (the Codex adapter over the real codex binary, its model the fake Responses server
at ``--base-url``). SIGUSR1 dumps every thread's stack to stderr. Prints
``READY {"endpoints": [...], "actors": [...], "pid": PID}`` once up; serves
until SIGTERM or stdin closes, then stops the node (which reaps the codex child).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from actors.app.echo import EchoActor
from actors.app.wiring import registry
from actors.codex.child import LaunchOptions
from actors.codex.facade import Adapter
from actors.codex.types import AdapterConfig, DynamicTool
from actors.conversation import ConversationRuntime, ToolRegistry
from actors.router.actor import RouterActor
from actors.router.catalog import DEFAULT_CATALOG, ModelCatalog
from actors.router.providers.scripted import ScriptedProvider
from actors.runs.session import SessionLoopService
from actors.runs.subagent import RunHostActor, ToolOutcome
from actors.types import ToolCall
from transport import Node

WEATHER = DynamicTool(
    name="get_weather",
    description="The weather in a city.",
    input_schema={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)


class NotesHost:
    """A subagent application host: one tool, ``note``, that answers with what it was given."""

    def render_tool_call(self, call: ToolCall) -> str:
        return call.name

    def execute_tool(self, call: ToolCall, operation_id: Any, budget: Any) -> Any:
        return ToolOutcome.success(f"noted {len(repr(call.arguments))} characters")  # bytes too

    def complete_capture(self, capture: Any, contents: str, budget: Any) -> Any:
        return ToolOutcome.success("saved")

    def record(self, event: Any) -> None:
        pass


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", default="fz")
    ap.add_argument("--bind", required=True)
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--codex", help="the codex binary (without it: no codex actor)")
    ap.add_argument("--base-url", help="the fake Responses server, for codex")
    ap.add_argument("--stdin-lifeline", action="store_true", help="stop when stdin closes (always on)")
    args = ap.parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the fuzzer asks for the stacks of a stall
    data = Path(args.data_dir)
    node = Node(args.name, bind=[args.bind], registry=registry())
    node.start()
    node.spawn(EchoActor, "echo")
    provider = ScriptedProvider(default=[{"text": "ok"}])
    # Only the scripted model: a fuzzed StartTurn naming the embedded one ("smollm2", "local", "default")
    # is answered UnknownModel instead of loading a 250 MB model into this process, which the fuzz test's
    # memory bound would count as growth (seed 18 drew such a frame once RouterStats grew a field).
    _, entry, scripted = DEFAULT_CATALOG.resolve("scripted")
    catalog = ModelCatalog((entry,), (scripted,), source="fuzz_node.py")
    node.spawn(
        RouterActor,
        "router",
        catalog=catalog,
        data_dir=data / "router",
        providers={"scripted": provider},
    )
    tools = ToolRegistry()
    tools.register(add)
    chat = ConversationRuntime.builder().node(node).llm("scripted").tools(tools).name("chat").build()
    node.spawn(SessionLoopService, "sessions")
    node.spawn(RunHostActor, "host", host=NotesHost(), effects=str(data / "host-effects.sqlite3"))
    adapter = None
    if args.codex:
        config = AdapterConfig(
            executable=args.codex,
            working_directory=str(data),
            model="fake-model",
            reasoning_effort=None,
            base_instructions="You are the kbus test model.",
            tools=(WEATHER,),
        )
        launch = LaunchOptions(model_base_url=args.base_url)
        adapter = Adapter.open(config, bus=node, name="codex", launch=launch)
    info = {"endpoints": list(node.endpoints), "actors": sorted(node.actors()), "pid": os.getpid()}
    print("READY " + json.dumps(info), flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    done.wait()
    if adapter is not None:
        adapter.close()
    chat.stop()
    node.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
