"""A conversation tool host in its own process: a node with a ``ToolHostActor`` at ``<name>/tools`` over an
effect store.

Tools: ``append(key)`` appends ``key`` to the ``--effect-log`` file (one line per real run), prints
``TOOL_ENTERED <key>``, and with ``--hold`` blocks until the test writes ``RELEASE <key>`` to this process's
stdin; ``rerun_append(key)`` does the same and is registered ``rerun_safe``.
Prints ``READY {"endpoints": [...]}`` once bound; serves until SIGTERM or stdin closes.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import sys
import threading
from pathlib import Path

from actors.app.wiring import registry
from actors.conversation import ToolHostActor, ToolRegistry
from transport import Node


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", required=True)
    ap.add_argument("--bind", required=True)
    ap.add_argument("--stdin-lifeline", action="store_true", help="stop when stdin closes (always on)")
    ap.add_argument("--effects", help="the effect store (SQLite file)")
    ap.add_argument("--effect-log", required=True, help="append-only file: one line per real tool run")
    ap.add_argument("--hold", action="store_true", help="tools block until RELEASE <key> on stdin")
    args = ap.parse_args()
    node = Node(args.name, bind=[args.bind], registry=registry())
    node.start()
    released: collections.defaultdict[str, threading.Event] = collections.defaultdict(threading.Event)
    log = Path(args.effect_log)

    def append(key: str) -> str:
        """Append ``key`` to the effect log."""
        with log.open("a") as f:
            f.write(key + "\n")
            f.flush()
            os.fsync(f.fileno())
        print("TOOL_ENTERED", key, flush=True)
        if args.hold and not released[key].wait(60):
            raise TimeoutError(f"{key} was never released")
        return f"{key} appended"

    def rerun_append(key: str) -> str:
        """Append ``key`` to the effect log (safe to run twice)."""
        return append(key)

    tools = ToolRegistry()
    tools.register(append, mutating=True)
    tools.register(rerun_append, mutating=True, rerun_safe=True)
    node.spawn(ToolHostActor, "tools", registry=tools, effects=args.effects)
    print("READY " + json.dumps({"endpoints": list(node.endpoints)}), flush=True)
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
    node.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
