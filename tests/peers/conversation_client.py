"""Enqueues ``--count`` messages ``<tag>-<i>`` into a conversation on another node, all at once, and prints
``RESULT {"outcomes": [[text, turn_index, final_text], ...]}`` in sending order (or ``RESULT {"error": ..}``).
"""

from __future__ import annotations

import argparse
import json
import sys

from actors.app.wiring import registry
from actors.conversation import ConversationRuntime
from transport import BusError, Node, Peer


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", required=True)
    ap.add_argument("--server", required=True, help="NAME=ENDPOINT")
    ap.add_argument("--address", required=True)
    ap.add_argument("--count", type=int, default=100)
    ap.add_argument("--tag", required=True)
    ap.add_argument("--stdin-lifeline", action="store_true")
    args = ap.parse_args()
    name, endpoint = args.server.split("=", 1)
    node = Node(args.name, registry=registry(), peers=[Peer(name, endpoint)])
    node.start()
    print("READY {}", flush=True)
    try:
        node.connect(node.peers()[name], wait=30)
        rt = ConversationRuntime.connect(node, args.address, timeout=90)
        texts = [f"{args.tag}-{i}" for i in range(args.count)]
        futures = [rt.enqueue_future(t) for t in texts]
        outcomes = [f.result(100) for f in futures]
        result: dict[str, object] = {
            "outcomes": [[t, o.turn_index, o.final_text] for t, o in zip(texts, outcomes, strict=True)]
        }
    except BusError as exc:
        result = {"error": type(exc).__name__, "message": str(exc)}
    finally:
        node.stop()
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
