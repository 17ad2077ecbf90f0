"""A conversation in its own process: a node with a Router (scripted provider), a ToolHostActor and a
ConversationActor at ``<name>/chat``.

Tools: ``add(a, b)`` and ``hold(key)``, which prints ``TOOL_ENTERED <key>`` and blocks until the test writes
``RELEASE <key>`` to this process's stdin; with ``--people`` also the people tools (``--plan-mode``: start in
plan mode). Prints ``READY {"endpoints": [...], "address": ...}`` once bound;
serves until SIGTERM or stdin closes.
"""

from __future__ import annotations

import argparse
import collections
import json
import signal
import sys
import threading
from pathlib import Path

from actors.app.wiring import registry
from actors.conversation import Compactor, ConversationRuntime, ToolRegistry
from actors.router.actor import RouterActor
from actors.router.providers.scripted import ScriptedProvider
from transport import Node


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", required=True)
    ap.add_argument("--bind", required=True)
    ap.add_argument("--stdin-lifeline", action="store_true", help="stop when stdin closes (always on)")
    ap.add_argument("--session-file", help="the conversation's JSONL (resumed when it exists)")
    ap.add_argument("--scripts", default="[]", help="the scripted provider's scripts (JSON list)")
    ap.add_argument("--keep-recent", type=int, default=2, help="the compactor's keep_recent_n")
    ap.add_argument("--data-dir", required=True)
    ap.add_argument(
        "--people", action="store_true", help="register todo_write, exit_plan_mode, request_plan_mode"
    )
    ap.add_argument("--plan-mode", action="store_true", help="start in plan mode")
    args = ap.parse_args()
    node = Node(args.name, bind=[args.bind], registry=registry())
    node.start()
    provider = ScriptedProvider(json.loads(args.scripts))
    node.spawn(RouterActor, "router", data_dir=args.data_dir, providers={"scripted": provider})
    released: collections.defaultdict[str, threading.Event] = collections.defaultdict(threading.Event)

    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    def hold(key: str) -> str:
        """Block until the test releases ``key``."""
        print("TOOL_ENTERED", key, flush=True)
        if not released[key].wait(60):
            raise TimeoutError(f"{key} was never released")
        return f"{key} released"

    tools = ToolRegistry()
    tools.register(add)
    tools.register(hold)
    builder = ConversationRuntime.builder().node(node).llm("scripted").tools(tools).name("chat")
    builder.compactor(Compactor(threshold_tokens=10**9, keep_recent_n=args.keep_recent))
    if args.session_file:
        builder.session_file(Path(args.session_file))
    builder.people_tools(args.people).plan_mode(args.plan_mode)
    rt = builder.build()
    info = {"endpoints": list(node.endpoints), "address": rt.address}
    print("READY " + json.dumps(info), flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())

    def commands() -> None:
        for line in sys.stdin:
            verb, _, key = line.strip().partition(" ")
            if verb == "RELEASE":
                released[key].set()
        done.set()

    threading.Thread(target=commands, daemon=True).start()
    done.wait()
    rt.stop()
    node.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
