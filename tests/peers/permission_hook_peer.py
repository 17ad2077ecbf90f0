"""A permission hook in its own process: a node serving a ``PermissionHookActor`` at ``<name>/hook`` whose
hook allows every call and prints ``CHECKED <tool>`` for each. Prints ``READY {"endpoints": [...],
"address": ...}`` once bound; serves until SIGTERM or stdin closes."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading

from actors.app.wiring import registry
from actors.conversation.permissions import PermissionDecision, PermissionHookActor, PermissionRequest
from transport import Node


class AllowAll:
    def check(self, request: PermissionRequest) -> PermissionDecision:
        print("CHECKED", request.tool_name, flush=True)
        return PermissionDecision.allow()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", required=True)
    ap.add_argument("--bind", required=True)
    ap.add_argument("--stdin-lifeline", action="store_true", help="stop when stdin closes (always on)")
    args = ap.parse_args()
    node = Node(args.name, bind=[args.bind], registry=registry())
    node.start()
    node.spawn(PermissionHookActor, "hook", hook=AllowAll())
    info = {"endpoints": list(node.endpoints), "address": f"{args.name}/hook"}
    print("READY " + json.dumps(info), flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())

    def lifeline() -> None:
        for _ in sys.stdin:
            pass
        done.set()

    threading.Thread(target=lifeline, daemon=True).start()
    done.wait()
    node.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
