"""Runs one ``run_session`` from its own node (e.g. in another network namespace) against a Router and a
host on a server node; prints ``RESULT {"answer": ...}`` or ``RESULT {"error": ...}`` and exits 0."""

from __future__ import annotations

import argparse
import json
import sys
import uuid

from actors.app.wiring import registry
from actors.runs.session import SessionRunRequest, run_session
from transport import BusError, KeyPair, Node, Peer, Security


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", required=True)
    ap.add_argument("--server", required=True, help="NAME=ENDPOINT=SERVERKEY")
    ap.add_argument("--secret-key-file", required=True)
    args = ap.parse_args()
    name, endpoint, key = args.server.split("=", 2)
    node = Node(
        args.name,
        registry=registry(),
        security=Security(keys=KeyPair.load(args.secret_key_file)),
        peers=[Peer(name, endpoint, key)],
    )
    node.start()
    try:
        node.connect(node.peers()[name], wait=30)
        request = SessionRunRequest(user_id="u1", operation_id=uuid.uuid4(), rounds_used=0, round_limit=5)
        result = {"answer": run_session(node, f"{name}/router", request, f"{name}/host", timeout=60)}
    except BusError as exc:
        result = {"error": type(exc).__name__, "message": str(exc)}
    finally:
        node.stop()
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
