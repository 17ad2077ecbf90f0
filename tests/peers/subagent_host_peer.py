"""A subagent ``Host`` in its own process: a node with a ``RunHostActor`` wrapping a small notes application.

Tools: ``note`` appends its ``text`` argument to the replaceable state ``notes`` and displays it; ``slow``
answers from another thread through a future; ``save`` designates the terminal answer as a capture, which
``complete_capture`` "saves"; ``hold`` appends its ``key`` argument to the ``--effect-log`` file, prints
``TOOL_ENTERED <key>`` and, with ``--hold``, never finishes (the test kills the process). ``--effects``
names the host's effect store. Every call is printed as ``CALL <name> <detail>`` (``fits_state`` answers
included, computed here from the budget that crossed the process boundary).
Prints ``READY {"endpoints": [...]}`` once bound; serves until SIGTERM or stdin closes.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

from actors.app.wiring import registry
from actors.runs.subagent import ContextBudget, RunHostActor, StateUpdate, ToolOutcome
from actors.types import ToolCall
from transport import Node


def say(*parts: Any) -> None:
    print("CALL", *parts, flush=True)


class NotesApp:
    """The application object (a Host)."""

    def __init__(self, effect_log: Path | None = None, hold: bool = False) -> None:
        self.notes: list[str] = []
        self.effect_log = effect_log
        self.hold = hold
        self.pending: list[concurrent.futures.Future[Any]] = []

    def render_tool_call(self, call: ToolCall) -> str:
        say("render", call.name)
        return f"{call.name}({json.dumps(call.arguments, sort_keys=True)})"

    def execute_tool(self, call: ToolCall, operation_id: uuid.UUID, budget: ContextBudget) -> Any:
        fits = budget.fits_state("notes", "x" * 100) and not budget.fits_state("notes", "x" * 10**7)
        say("execute_tool", call.name, budget.estimated_tokens(), budget.max_input_tokens(), fits)
        if call.name == "note":
            self.notes.append(str(call.arguments.get("text", "")))
            value = "\n".join(self.notes)
            return ToolOutcome(
                text=value,
                ok=True,
                state_updates=(StateUpdate(key="notes", text=value),),
                displayed_state_keys=("notes",),
            )
        if call.name == "slow":
            future: concurrent.futures.Future[Any] = concurrent.futures.Future()
            threading.Thread(target=lambda: future.set_result(ToolOutcome.success("slow done"))).start()
            return future
        if call.name == "hold" and self.effect_log is not None:
            key = str(call.arguments.get("key", ""))
            with self.effect_log.open("a") as f:
                f.write(key + "\n")
                f.flush()
                os.fsync(f.fileno())
            print("TOOL_ENTERED", key, flush=True)
            if not self.hold:
                return ToolOutcome.success(f"{key} appended")
            held: concurrent.futures.Future[Any] = concurrent.futures.Future()
            self.pending.append(held)  # never resolved: the effect is still running when we die
            return held
        if call.name == "save":
            return ToolOutcome(
                text="saving the answer", ok=True, capture={"file": call.arguments.get("file")}
            )
        return ToolOutcome.failure(f"no tool {call.name}")

    def complete_capture(self, capture: Any, contents: str, budget: ContextBudget) -> Any:
        say("complete_capture", json.dumps(capture), json.dumps(contents))
        return ToolOutcome.success(f"saved {len(contents)} characters to {capture['file']}")

    def record(self, event: Any) -> None:
        say("record", type(event).__name__)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", required=True)
    ap.add_argument("--bind", required=True)
    ap.add_argument("--stdin-lifeline", action="store_true", help="stop when stdin closes (always on)")
    ap.add_argument("--effects", help="the effect store (SQLite file)")
    ap.add_argument("--effect-log", help="append-only file: one line per real run of the hold tool")
    ap.add_argument("--hold", action="store_true", help="the hold tool never finishes")
    args = ap.parse_args()
    node = Node(args.name, bind=[args.bind], registry=registry())
    node.start()
    app = NotesApp(Path(args.effect_log) if args.effect_log else None, args.hold)
    node.spawn(RunHostActor, "host", host=app, effects=args.effects)
    print("READY " + json.dumps({"endpoints": list(node.endpoints)}), flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    done.wait()
    node.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
